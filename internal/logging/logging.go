// Package logging builds the zap logger every outbox-relay binary logs
// with, so that the relay, the reward consumer and the tools write the same
// JSON: an ISO 8601 "ts", durations with their unit ("30s", not 30).
package logging

import (
	"fmt"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Formats are the values New accepts for format.
const (
	// FormatJSON writes one JSON object a line, for log collectors.
	FormatJSON = "json"
	// FormatConsole writes coloured, aligned text for a person at a terminal.
	FormatConsole = "console"
)

// New returns a logger at level ("debug", "info", "warn", "error") in format
// (FormatJSON, or FormatConsole; "" means JSON).
func New(level, format string) (*zap.Logger, error) {
	var zc zap.Config
	switch format {
	case FormatConsole:
		zc = zap.NewDevelopmentConfig()
		zc.EncoderConfig.EncodeLevel = zapcore.CapitalColorLevelEncoder
	case FormatJSON, "":
		zc = zap.NewProductionConfig()
		zc.EncoderConfig.TimeKey = "ts"
		zc.EncoderConfig.EncodeTime = zapcore.ISO8601TimeEncoder
	default:
		return nil, fmt.Errorf("log format %q: want %s or %s", format, FormatJSON, FormatConsole)
	}
	zc.EncoderConfig.EncodeDuration = zapcore.StringDurationEncoder
	lvl, err := zapcore.ParseLevel(level)
	if err != nil {
		return nil, fmt.Errorf("log level %q: want debug, info, warn or error", level)
	}
	zc.Level = zap.NewAtomicLevelAt(lvl)
	zc.DisableStacktrace = true
	return zc.Build()
}
