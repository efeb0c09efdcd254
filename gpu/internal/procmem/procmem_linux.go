//go:build linux

package procmem

import (
	"errors"

	"golang.org/x/sys/unix"
)

// maxPerCall caps the bytes requested by one call so that the kernel's
// MAX_RW_COUNT (about 2 GiB) never silently truncates a request; partial
// transfers are handled anyway, this just keeps them rare.
const maxPerCall = 1 << 30

// Read copies every range from process pid into local.
func Read(pid int, local []byte, rs []Range) (Stats, error) {
	return transfer(false, pid, local, rs)
}

// Write copies every range from local into process pid.
func Write(pid int, local []byte, rs []Range) (Stats, error) {
	return transfer(true, pid, local, rs)
}

func transfer(write bool, pid int, local []byte, rs []Range) (Stats, error) {
	var st Stats
	if err := checkLocal(local, rs); err != nil {
		return st, err
	}
	op := "process_vm_readv"
	if write {
		op = "process_vm_writev"
	}
	n := min(len(rs), IOVMax)
	liov := make([]unix.Iovec, 0, n)
	riov := make([]unix.RemoteIovec, 0, n)

	i := 0          // first range not fully transferred
	var skip uint64 // bytes of rs[i] already transferred
	for i < len(rs) {
		// Build one call's worth of iovecs starting at (i, skip).
		liov, riov = liov[:0], riov[:0]
		var want uint64
		for j := i; j < len(rs) && len(liov) < IOVMax && want < maxPerCall; j++ {
			r := rs[j]
			off := uint64(0)
			if j == i {
				off = skip
			}
			l := r.Len - off
			if l == 0 {
				continue
			}
			l = min(l, maxPerCall-want)
			var v unix.Iovec
			v.Base = &local[r.Local+off]
			v.SetLen(int(l))
			liov = append(liov, v)
			riov = append(riov, unix.RemoteIovec{Base: uintptr(r.Remote + off), Len: int(l)})
			want += l
		}
		if want == 0 {
			break // only zero-length ranges left
		}
		var got int
		var err error
		for {
			if write {
				got, err = unix.ProcessVMWritev(pid, liov, riov, 0)
			} else {
				got, err = unix.ProcessVMReadv(pid, liov, riov, 0)
			}
			st.Calls++
			if !errors.Is(err, unix.EINTR) {
				break
			}
		}
		if err == nil && got <= 0 {
			err = ErrNoProgress
		}
		if err != nil {
			return st, &Error{Op: op, PID: pid, Addr: rs[i].Remote + skip, Done: st.Bytes, Err: err}
		}
		st.Bytes += int64(got)
		// Advance (i, skip) by got bytes; a short count means the kernel
		// stopped (fault or MAX_RW_COUNT) and the next call resumes there.
		adv := uint64(got)
		for adv > 0 && i < len(rs) {
			left := rs[i].Len - skip
			if adv < left {
				skip += adv
				break
			}
			adv -= left
			i++
			skip = 0
		}
		for i < len(rs) && rs[i].Len == skip {
			i++
			skip = 0
		}
	}
	return st, nil
}
