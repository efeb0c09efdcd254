package cli

import (
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/urfave/cli/v2"

	"github.com/ringside-kv/ringside/ring"
)

// serveCommand runs the ring demo until the sidecar lands: it creates a
// request and a response ring in --dir and echoes every record back.
func serveCommand() *cli.Command {
	return &cli.Command{
		Name:  "serve",
		Usage: "run the sidecar (for now: a ring echo demo in --dir)",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "dir", Value: ring.DefaultDir, Usage: "directory for rings and the socket", EnvVars: env("dir")},
		},
		Action: func(c *cli.Context) error {
			log, err := logger(c)
			if err != nil {
				return err
			}
			dir := c.String("dir")
			if err := ring.EnsureDir(dir, 0o700); err != nil {
				return err
			}
			req, err := ring.Create(filepath.Join(dir, "demo.req"), ring.Options{})
			if err != nil {
				return err
			}
			defer req.Remove()
			resp, err := ring.Create(filepath.Join(dir, "demo.resp"), ring.Options{CreatorProducer: true})
			if err != nil {
				return err
			}
			defer resp.Remove()
			cons, _ := ring.NewConsumer(req.Ring, ring.DefaultWait)
			prod, _ := ring.NewProducer(resp.Ring, ring.DefaultWait)
			log.Info().Str("request", req.Path()).Str("response", resp.Path()).Msg("ring echo demo ready")
			stop := make(chan os.Signal, 1)
			signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
			for {
				select {
				case <-stop:
					log.Info().Msg("stopping")
					return nil
				default:
				}
				err := cons.Wait(time.Now().Add(200 * time.Millisecond))
				if errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, ring.ErrPeerDead) || errors.Is(err, ring.ErrPeerClosed) {
					continue
				}
				if err != nil {
					return err
				}
				for {
					rec, err := cons.Next()
					if err != nil {
						break
					}
					if err := prod.Write(rec.Type, rec.Flags, rec.Seq, rec.Payload, time.Now().Add(time.Second)); err != nil {
						return fmt.Errorf("echo: %w", err)
					}
				}
				cons.Commit()
			}
		},
	}
}
