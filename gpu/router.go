package gpu

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
)

// Router combines backends: each region goes to the first engine that
// supports its kind (KindSupporter), and ops follow their region. The
// sidecar runs NewRouter(cuda, host) when the CUDA backend is available, so
// one engine serves GPU (CUDAIPC) and host (HostProcess) regions side by
// side.
type Router struct {
	engines []Engine

	mu     sync.RWMutex
	routes map[Handle]route
	next   Handle
	closed bool
}

type route struct {
	e     Engine
	inner Handle
}

var _ Engine = (*Router)(nil)

// NewRouter returns a Router over engines, in order of preference. It owns
// them: Close closes them all.
func NewRouter(engines ...Engine) *Router {
	return &Router{engines: engines, routes: map[Handle]route{}}
}

// Name joins the engines' names with "+" ("cuda+host").
func (r *Router) Name() string {
	names := make([]string, len(r.engines))
	for i, e := range r.engines {
		names[i] = e.Name()
	}
	return strings.Join(names, "+")
}

// Supports reports whether any engine supports k.
func (r *Router) Supports(k Kind) bool {
	for _, e := range r.engines {
		if Supports(e, k) {
			return true
		}
	}
	return false
}

// Engines returns the routed engines, in order of preference.
func (r *Router) Engines() []Engine { return append([]Engine(nil), r.engines...) }

// Register hands reg to the first engine that supports its kind.
func (r *Router) Register(reg Region) (Handle, error) {
	var target Engine
	for _, e := range r.engines {
		if Supports(e, reg.Kind) {
			target = e
			break
		}
	}
	if target == nil {
		if err := reg.Validate(); err != nil {
			return 0, err
		}
		return 0, fmt.Errorf("%w: no copy backend of %s serves %v regions", ErrUnsupported, r.Name(), reg.Kind)
	}
	r.mu.RLock()
	closed := r.closed
	r.mu.RUnlock()
	if closed {
		return 0, fmt.Errorf("gpu: register: %w", os.ErrClosed)
	}
	inner, err := target.Register(reg)
	if err != nil {
		return 0, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for {
		r.next++
		if _, used := r.routes[r.next]; r.next != 0 && !used {
			break
		}
	}
	r.routes[r.next] = route{target, inner}
	return r.next, nil
}

// Unregister forgets h in its engine.
func (r *Router) Unregister(h Handle) error {
	r.mu.Lock()
	rt, ok := r.routes[h]
	delete(r.routes, h)
	r.mu.Unlock()
	if !ok {
		return fmt.Errorf("%w: handle %d", ErrUnknownRegion, h)
	}
	return rt.e.Unregister(rt.inner)
}

// Submit passes op to its region's engine; errors and results name the
// Router's handle.
func (r *Router) Submit(op Op, done func(Result)) error {
	r.mu.RLock()
	rt, ok := r.routes[op.Region]
	closed := r.closed
	r.mu.RUnlock()
	outer := op.Region
	switch {
	case closed:
		return &CopyError{Dir: op.Dir, Region: outer, Index: -1, Err: os.ErrClosed}
	case !ok:
		return &CopyError{Dir: op.Dir, Region: outer, Index: -1, Err: ErrUnknownRegion}
	case done == nil:
		return &CopyError{Dir: op.Dir, Region: outer, Index: -1, Err: fmt.Errorf("%w: nil done callback", ErrInvalidOp)}
	}
	op.Region = rt.inner
	err := rt.e.Submit(op, func(res Result) {
		var ce *CopyError
		if errors.As(res.Err, &ce) {
			ce.Region = outer
		}
		done(res)
	})
	var ce *CopyError
	if errors.As(err, &ce) {
		ce.Region = outer
	}
	return err
}

// Close closes every engine.
func (r *Router) Close() error {
	r.mu.Lock()
	r.closed = true
	r.mu.Unlock()
	var errs []error
	for _, e := range r.engines {
		errs = append(errs, e.Close())
	}
	return errors.Join(errs...)
}
