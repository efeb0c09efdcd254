// Package logx builds the zerolog logger from the command-line settings.
// Libraries take a zerolog.Logger and default to zerolog.Nop().
package logx

import (
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/rs/zerolog"
)

// New returns a logger writing JSON (format "json") or human-readable
// console lines (format "console") to w at the given level.
func New(w io.Writer, format, level string) (zerolog.Logger, error) {
	lvl, err := zerolog.ParseLevel(strings.ToLower(level))
	if err != nil || level == "" {
		return zerolog.Nop(), fmt.Errorf("log.level %q: want trace, debug, info, warn or error", level)
	}
	switch format {
	case "json":
	case "console":
		w = zerolog.ConsoleWriter{Out: w, TimeFormat: time.RFC3339}
	default:
		return zerolog.Nop(), fmt.Errorf("log.format %q: want json or console", format)
	}
	return zerolog.New(w).Level(lvl).With().Timestamp().Logger(), nil
}

// Stderr is New on standard error.
func Stderr(format, level string) (zerolog.Logger, error) { return New(os.Stderr, format, level) }
