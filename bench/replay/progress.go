package replay

import (
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/schollz/progressbar/v3"
)

// progress is the terminal progress bar of a long run: requests replayed
// over all runs of the sweep. Engines only bump an atomic counter; a
// ticker moves the bar, so the bar costs the replay nothing measurable.
type progress struct {
	bar  *progressbar.ProgressBar
	n    atomic.Int64
	stop chan struct{}
	wg   sync.WaitGroup
	once sync.Once
	mu   sync.Mutex
	desc string
}

func newProgress(on bool, w io.Writer, total int64) *progress {
	p := &progress{}
	if !on {
		return p
	}
	p.bar = progressbar.NewOptions64(total,
		progressbar.OptionSetWriter(w),
		progressbar.OptionSetDescription("replay"),
		progressbar.OptionSetWidth(30),
		progressbar.OptionShowCount(),
		progressbar.OptionShowIts(),
		progressbar.OptionSetItsString("req"),
		progressbar.OptionThrottle(200*time.Millisecond),
		progressbar.OptionClearOnFinish(),
		progressbar.OptionSetPredictTime(true),
	)
	p.stop = make(chan struct{})
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		t := time.NewTicker(250 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-p.stop:
				return
			case <-t.C:
				p.update()
			}
		}
	}()
	return p
}

func (p *progress) update() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.bar != nil {
		p.bar.Describe(p.desc)
		p.bar.Set64(p.n.Load())
	}
}

func (p *progress) add(n int64) { p.n.Add(n) }

func (p *progress) describe(s string) {
	p.mu.Lock()
	p.desc = s
	p.mu.Unlock()
}

func (p *progress) finish() {
	if p.bar == nil {
		return
	}
	p.once.Do(func() {
		close(p.stop)
		p.wg.Wait()
		p.mu.Lock()
		p.bar.Finish()
		p.bar.Clear()
		p.mu.Unlock()
	})
}
