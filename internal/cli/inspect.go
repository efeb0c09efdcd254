package cli

import (
	"fmt"

	"github.com/urfave/cli/v2"

	"github.com/ringside-kv/ringside/ring"
)

func inspectCommand() *cli.Command {
	return &cli.Command{
		Name:  "inspect",
		Usage: "print the live state of ringside objects",
		Subcommands: append([]*cli.Command{{
			Name:      "ring",
			Usage:     "print a ring file's header and positions",
			ArgsUsage: "PATH...",
			Action: func(c *cli.Context) error {
				if c.NArg() == 0 {
					return fmt.Errorf("inspect ring: give at least one ring file path")
				}
				for _, path := range c.Args().Slice() {
					f, err := ring.Open(path, 0)
					if err != nil {
						return err
					}
					h := f.Header()
					tail, head := f.Positions()
					prod, cons := f.Peers()
					fmt.Fprintf(c.App.Writer, "%s\n  version %d  capacity %d  max record %d  epoch %#x\n  tail %d  head %d  used %d bytes\n  producer pid %d (alive %v)  consumer pid %d (alive %v)\n",
						path, h.Version, h.Capacity, h.MaxRecord, h.Epoch, tail, head, tail-head,
						prod, prod != 0 && f.ProducerAlive(), cons, cons != 0 && f.ConsumerAlive())
					f.Close()
				}
				return nil
			},
		}}, inspectSubcommands...),
	}
}

// inspectSubcommands is extended by other files (the sidecar inspector).
var inspectSubcommands []*cli.Command
