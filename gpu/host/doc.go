// Package host is the copy engine's CPU backend (a gpu.Engine).
//
// HostShared regions (another file mapped in the sidecar) are plain copy().
// HostProcess regions are read and written with process_vm_readv(2) and
// process_vm_writev(2) in the engine's address space (Region.PID is the pid as
// seen from the sidecar's pid namespace). The kernel allows this
// only with ptrace access mode PTRACE_MODE_ATTACH_REALCREDS to the target:
// the same uid (and the target not made non-dumpable), or CAP_SYS_PTRACE,
// and Yama's kernel.yama.ptrace_scope must permit it: 0 allows same-uid
// peers, 1 only descendants (or a PR_SET_PTRACER exception set by the
// engine), 2 requires CAP_SYS_PTRACE, 3 forbids it. A denied request fails
// with EPERM.
//
// In Kubernetes this matters: the sidecar and the engine are separate
// containers, so the pod needs shareProcessNamespace: true for the sidecar
// to see the engine's pid at all, both containers must run as the same uid
// (runAsUser), and since the sidecar is not the engine's ancestor, a node
// with ptrace_scope=1 (the Ubuntu default) also needs either the engine to
// call prctl(PR_SET_PTRACER, sidecar pid) or the sidecar to be granted
// CAP_SYS_PTRACE, which baseline Pod Security rejects (it is not in the
// allowed add list). Prefer HostShared regions where the engine can place
// its KV in a shared file.
package host
