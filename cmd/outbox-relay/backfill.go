package main

import (
	"context"
	"fmt"
	"io"
	"os"

	"github.com/nats-io/nats.go"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/relay"
)

// backfill creates the slot from an exported snapshot and publishes the
// rows already waiting in the outbox, showing progress on a terminal.
func backfill(ctx context.Context, cfg config.Config, nc *nats.Conn, log *zap.Logger, out io.Writer) (relay.BackfillReport, error) {
	tty := isTerminal(out)
	progress := func(table string, done, total int) {
		pct := 100
		if total > 0 {
			pct = done * 100 / total
		}
		if tty {
			fmt.Fprintf(out, "\rbackfill %s: %d/%d rows (%d%%)", table, done, total, pct)
			if done == total {
				fmt.Fprintln(out)
			}
			return
		}
		log.Info("backfill progress", zap.String("table", table), zap.Int("done", done), zap.Int("total", total))
	}
	return relay.Backfill(ctx, cfg.Relay(), nc, log.Named("backfill"), progress)
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
