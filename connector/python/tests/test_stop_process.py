"""stop_process: SIGSTOP and wait until every thread of the process is
stopped, not only its main one."""

import os
import signal
import subprocess
import sys

from ringside.sidecar_process import stop_process

# Four threads spinning beside the main one, which sleeps.
SPINNERS = """
import threading, time
def spin():
    while True:
        pass
for _ in range(4):
    threading.Thread(target=spin, daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""


def states(pid):
    out = []
    for tid in os.listdir("/proc/%d/task" % pid):
        with open("/proc/%d/task/%s/stat" % (pid, tid)) as f:
            out.append(f.read().rsplit(")", 1)[1].split()[0])
    return out


def test_stop_process_waits_for_every_thread():
    p = subprocess.Popen([sys.executable, "-c", SPINNERS], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        assert len(states(p.pid)) == 5
        stop_process(p.pid)
        got = states(p.pid)
        assert all(s in ("T", "t") for s in got), got
        os.kill(p.pid, signal.SIGCONT)
    finally:
        p.kill()
        p.wait(10)
