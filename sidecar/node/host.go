package node

import "os"

var osHostname = os.Hostname
