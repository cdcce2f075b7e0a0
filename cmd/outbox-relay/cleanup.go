package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/cleanup"
	"github.com/outbox-relay/outbox-relay/internal/config"
)

type cleanupFlags struct {
	olderThan    time.Duration
	storedMargin time.Duration
	mode         string
	batch        int
	pause        time.Duration
	dryRun       bool
	asJSON       bool
	progress     bool
}

func newCleanupCmd(g *globals) *cobra.Command {
	var f cleanupFlags
	cmd := &cobra.Command{
		Use:   "cleanup --older-than <duration> [--mode stream|published] [--dry-run]",
		Short: "Delete outbox rows that were provably relayed, in small batches",
		Long: `Deletes outbox rows whose occurred_at is older than --older-than and that are
provably relayed, in batches of --batch-size rows, each its own short
transaction (locked rows are skipped, not waited for):

  --mode stream     (default) the row's event id is in the event stream; rows
                    not yet published, lost, dead-lettered or expired from the
                    stream are kept
  --mode published  the row's publish_state is 'PUBLISHED' (set by a polling
                    relay or a marker after the broker's ack)

It never deletes a row whose event the stream does not hold (stream mode),
nor one whose event the stream stored less than --stored-margin ago: the
stream acknowledges before it syncs to disk (every 2 minutes by default),
so until then the row may be the only durable copy. A stream in memory is
refused; one with fewer than 3 replicas is warned about.
Keep --older-than above the window you reconcile: a reconcile over deleted
rows reports their events as unexpected. The role needs DELETE on the
outbox tables. Exit status 0 when every row older than the cutoff was
deleted, 1 when some remain (not proven relayed; see the report).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if !cmd.Flags().Changed("older-than") {
				return fmt.Errorf("%w: --older-than is required (e.g. --older-than 168h keeps a week of rows)", config.ErrInvalid)
			}
			cfg, err := g.load()
			if err != nil {
				return err
			}
			return runCleanup(cmd.Context(), cmd.OutOrStdout(), cfg, f)
		},
	}
	fl := cmd.Flags()
	fl.DurationVar(&f.olderThan, "older-than", 0, "delete only rows whose occurred_at is older than this (required), e.g. 168h")
	fl.DurationVar(&f.storedMargin, "stored-margin", cleanup.DefaultStoredMargin, fmt.Sprintf("stream mode: keep rows whose event was stored within this long (at least %s, JetStream's default sync interval)", cleanup.MinStoredMargin))
	fl.StringVar(&f.mode, "mode", string(cleanup.ModeStream), "how a row is proven relayed: stream or published")
	fl.IntVar(&f.batch, "batch-size", cleanup.DefaultBatchSize, "rows per DELETE transaction")
	fl.DurationVar(&f.pause, "pause", 0, fmt.Sprintf("sleep between batches, to spread the load (at most %s)", cleanup.MaxPause))
	fl.BoolVar(&f.dryRun, "dry-run", false, "count what would be deleted, delete nothing")
	fl.BoolVar(&f.asJSON, "json", false, "print JSON for scripts")
	fl.BoolVar(&f.progress, "progress", false, "show progress on stderr")
	return cmd
}

func runCleanup(ctx context.Context, out io.Writer, cfg config.Config, f cleanupFlags) error {
	cc := cleanup.Config{
		Router:       cfg.Router,
		Stream:       cfg.NATS.Stream,
		Mode:         cleanup.Mode(f.mode),
		OlderThan:    f.olderThan,
		StoredMargin: f.storedMargin,
		BatchSize:    f.batch,
		Pause:        f.pause,
		DryRun:       f.dryRun,
	}
	if cc.Mode != cleanup.ModeStream && cc.Mode != cleanup.ModePublished {
		return fmt.Errorf("%w: --mode %q: use stream or published", config.ErrInvalid, f.mode)
	}
	if f.olderThan <= 0 {
		return fmt.Errorf("%w: --older-than must be a positive age (e.g. 168h); rows within the reconcile window are still needed", config.ErrInvalid)
	}
	if f.batch < 1 || f.batch > cleanup.MaxBatchSize {
		return fmt.Errorf("%w: --batch-size %d: use 1 to %d", config.ErrInvalid, f.batch, cleanup.MaxBatchSize)
	}
	pool, err := sqlPool(ctx, cfg.Postgres.URL, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	var js jetstream.JetStream
	if cc.Mode == cleanup.ModeStream {
		nc, err := connectNATS(cfg.NATS, zap.NewNop(), "outbox-relay cleanup")
		if err != nil {
			return err
		}
		defer nc.Close()
		if js, err = jetstream.New(nc); err != nil {
			return err
		}
	}
	var opts []cleanup.Option
	if f.progress {
		opts = append(opts, cleanup.WithProgress(func(tr cleanup.TableReport) {
			fmt.Fprintf(os.Stderr, "\r%s: %d of %d rows deleted, %d batches", tr.Table, tr.Deleted, tr.Candidates, tr.Batches)
		}))
	}
	rep, err := cleanup.Run(ctx, pool, js, cc, opts...)
	if f.progress {
		fmt.Fprintln(os.Stderr)
	}
	if err != nil {
		return err
	}
	if f.asJSON {
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			return err
		}
	} else {
		printCleanup(out, rep)
	}
	for _, t := range rep.Tables {
		if t.Remaining > 0 && !rep.DryRun {
			return exitCode(1)
		}
	}
	return nil
}

func printCleanup(w io.Writer, r *cleanup.Report) {
	fmt.Fprintf(w, "Outbox rows with occurred_at before %s, proven relayed by %s", r.Cutoff.Format(time.RFC3339), r.Mode)
	if r.Mode == cleanup.ModeStream {
		fmt.Fprintf(w, " (%d events read)", r.StreamMessages)
	}
	fmt.Fprintf(w, ", in %s:\n", r.Duration.Round(time.Millisecond))
	for _, warning := range r.Warnings {
		fmt.Fprintln(w, "warning:", warning)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "TABLE\tOLDER THAN CUTOFF\t%s\tSTORED RECENTLY\tREMAINING\tBATCHES\t\n", map[bool]string{true: "WOULD DELETE", false: "DELETED"}[r.DryRun])
	remaining, recent := int64(0), int64(0)
	defer func() {
		for _, t := range r.Tables {
			if t.NoOccurredAt > 0 {
				fmt.Fprintf(w, "%s: %d rows have a NULL occurred_at and are never deleted (nor reconciled): set it.\n", t.Table, t.NoOccurredAt)
			}
		}
	}()
	for _, t := range r.Tables {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t\n", t.Table, t.Candidates, t.Deleted, t.StoredRecently, t.Remaining, t.Batches)
		remaining += t.Remaining
		recent += t.StoredRecently
	}
	_ = tw.Flush()
	if remaining > 0 && !r.DryRun {
		fmt.Fprintf(w, "\n%d rows older than the cutoff were kept: not proven relayed (not yet published, dead-lettered, lost or expired from the stream), locked, or inserted meanwhile. `outbox-relay reconcile` lists the missing ones.\n", remaining)
		for _, t := range r.Tables {
			if t.OldestRemaining != nil {
				fmt.Fprintf(w, "%s: the oldest kept row is from %s; each run reads the stream from there, so settle rows that cannot be proven (reconcile --repair, or delete them by hand).\n", t.Table, t.OldestRemaining.UTC().Format(time.RFC3339))
			}
		}
		if recent > 0 {
			fmt.Fprintf(w, "%d of them have an event stored after %s (within the stored margin): a later run deletes them.\n", recent, r.StoredBefore.Format(time.RFC3339))
		}
	} else if r.DryRun {
		fmt.Fprintln(w, "\nDry run: nothing was deleted.")
	}
}
