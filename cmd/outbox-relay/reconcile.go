package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/reconcile"
	"github.com/outbox-relay/outbox-relay/replication"
)

// sqlPool returns a pool of ordinary (non-replication) connections to url
// that connects on first use.
func sqlPool(ctx context.Context, url string, maxConns int32) (*pgxpool.Pool, error) {
	pc, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("%w: postgres.url: cannot parse the connection string (check its syntax; percent-encode special characters in the password)", config.ErrInvalid)
	}
	delete(pc.ConnConfig.RuntimeParams, "replication")
	pc.MaxConns = maxConns
	pc.MinConns = 0
	if pc.ConnConfig.RuntimeParams["application_name"] == "" {
		pc.ConnConfig.RuntimeParams["application_name"] = "outbox-relay"
	}
	// Repair routes rows read as text, like the replication stream's: the
	// router parses timestamps in ISO form, whatever the database's or
	// role's DateStyle and TimeZone.
	pc.ConnConfig.RuntimeParams["DateStyle"] = "ISO"
	pc.ConnConfig.RuntimeParams["TimeZone"] = "UTC"
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("postgres pool: %w", err)
	}
	return pool, nil
}

// refuseActiveSlot fails while a relay streams from the slot: pending rows
// are then being published by it, and --include-pending would publish them
// a second time — stored twice once the relay lags by more than the
// duplicate window.
func refuseActiveSlot(ctx context.Context, cfg config.Config) error {
	st, err := replication.ReleasedStatus(ctx, cfg.Postgres.URL, cfg.Postgres.Slot)
	if err != nil {
		return err
	}
	if st.Active {
		return fmt.Errorf("%w: --include-pending: slot %s is streaming to pid %d, so a relay is publishing the pending rows; stop it first (see \"Recovering after a lost slot\"), or repair without --include-pending", replication.ErrSlotInUse, cfg.Postgres.Slot, st.ActivePID)
	}
	return nil
}

// reconcileConfig is the part of reconcile.Config the configuration file
// decides.
func reconcileConfig(cfg config.Config) reconcile.Config {
	return reconcile.Config{
		Router:           cfg.Router,
		Stream:           cfg.NATS.Stream,
		DeadLetterStream: cfg.NATS.DeadLetterStream,
		Slot:             cfg.Postgres.Slot,
	}
}

// parseWhen reads a point in time: a duration before now ("24h", "90m"),
// an RFC 3339 time, or a date (midnight UTC).
func parseWhen(flag, s string, now time.Time) (time.Time, error) {
	if d, err := time.ParseDuration(s); err == nil {
		if d < 0 {
			return time.Time{}, fmt.Errorf("%w: --%s %s: give a positive duration (how long ago)", config.ErrInvalid, flag, s)
		}
		return now.Add(-d), nil
	}
	for _, layout := range []string{time.RFC3339Nano, "2006-01-02T15:04:05", "2006-01-02 15:04:05", "2006-01-02"} {
		if t, err := time.Parse(layout, s); err == nil {
			return t, nil
		}
	}
	return time.Time{}, fmt.Errorf("%w: --%s %q: use a duration before now (24h, 90m), an RFC 3339 time (2026-11-29T09:00:00Z) or a date (2026-11-29, UTC)", config.ErrInvalid, flag, s)
}

type reconcileFlags struct {
	since, until   string
	asJSON         bool
	repair         bool
	includePending bool
	confirmWait    time.Duration
	clockSkew      time.Duration
	maxRows        int
	list           int
	metricsFile    string
}

// reconcileOutput is what `reconcile --json` prints.
type reconcileOutput struct {
	Report *reconcile.Report       `json:"report"`
	Repair *reconcile.RepairReport `json:"repair,omitempty"`
	// After is the reconciliation re-run after a repair.
	After *reconcile.Report `json:"after,omitempty"`
	// PublicationGap is the slot's open publication gap, if one is
	// recorded: its rows are pending until the relay fills it.
	PublicationGap *gapStatus `json:"publication_gap,omitempty"`
}

func newReconcileCmd(g *globals) *cobra.Command {
	var f reconcileFlags
	cmd := &cobra.Command{
		Use:   "reconcile --since <when> [--until <when>] [--json] [--repair]",
		Short: "Compare the outbox rows with the stream by event id; --repair republishes the missing events",
		Long: `Compares the outbox rows whose occurred_at is in [--since, --until) with the
events in the stream, by event id, per table and aggregate type:

  missing        the slot confirmed the row, but its event is in neither the
                 stream nor the dead-letter stream: it was lost (lost slot,
                 failover, rows from before the slot, or deleted by hand)
  pending        not in the stream yet and not yet confirmed by the slot:
                 the relay may still be publishing it
  dead-lettered  the event is in the dead-letter stream (outbox-relay dlq)
  unexpected     an event in the window whose row is not in the table
                 (deleted after publishing, or from another database)

--repair republishes the missing events from their rows in aggregate order,
with their original event ids (Nats-Msg-Id), then reconciles again. A
republished event has no Outbox-Commit-LSN/Outbox-Commit-Time and carries
Outbox-Repaired-At. Exit status 0 when nothing is missing or pending, 1
otherwise, 2 for a bad configuration or flag.

--since/--until take a duration before now (24h), an RFC 3339 time or a
date (UTC).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := g.load()
			if err != nil {
				return err
			}
			return runReconcile(cmd.Context(), cmd.OutOrStdout(), cfg, f)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.since, "since", "", "start of the window (required): 24h, 2026-11-29T09:00:00Z or 2026-11-29")
	fl.StringVar(&f.until, "until", "", "end of the window (default now)")
	fl.BoolVar(&f.asJSON, "json", false, "print JSON for scripts")
	fl.BoolVar(&f.repair, "repair", false, "republish the missing events in aggregate order, then reconcile again")
	fl.BoolVar(&f.includePending, "include-pending", false, "with --repair, also republish pending events (when no relay runs on the slot, e.g. after a lost slot)")
	fl.DurationVar(&f.confirmWait, "confirm-wait", reconcile.DefaultConfirmWait, "how long to wait for the slot to confirm the rows read")
	fl.DurationVar(&f.clockSkew, "clock-skew", reconcile.DefaultClockSkew, "margin for clock differences between PostgreSQL and NATS")
	fl.IntVar(&f.maxRows, "max-rows", reconcile.DefaultMaxRows, "refuse windows with more rows (memory bound, ~200 bytes per row)")
	fl.IntVar(&f.list, "list", 20, "how many events of each kind to list (table output)")
	fl.StringVar(&f.metricsFile, "metrics-file", "", "also write the outbox_relay_reconcile_* metrics to this file (node_exporter textfile collector)")
	_ = cmd.MarkFlagRequired("since")
	return cmd
}

func runReconcile(ctx context.Context, out io.Writer, cfg config.Config, f reconcileFlags) error {
	now := time.Now()
	rc := reconcileConfig(cfg)
	var err error
	if rc.Since, err = parseWhen("since", f.since, now); err != nil {
		return err
	}
	if f.until != "" {
		if rc.Until, err = parseWhen("until", f.until, now); err != nil {
			return err
		}
	}
	if !rc.Until.IsZero() && !rc.Until.After(rc.Since) {
		return fmt.Errorf("%w: --until must be after --since", config.ErrInvalid)
	}
	rc.ConfirmWait, rc.ClockSkew, rc.MaxRows = f.confirmWait, f.clockSkew, f.maxRows
	if rc.ConfirmWait == 0 {
		rc.ConfirmWait = -1 // 0 on the command line means "do not wait"
	}
	if f.includePending {
		if err := refuseActiveSlot(ctx, cfg); err != nil {
			return err
		}
	}
	pool, err := sqlPool(ctx, cfg.Postgres.URL, 4)
	if err != nil {
		return err
	}
	defer pool.Close()
	nc, err := connectNATS(cfg.NATS, zap.NewNop(), "outbox-relay reconcile")
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}

	res := reconcileOutput{}
	if res.PublicationGap, err = readGapStatus(ctx, cfg); err != nil {
		return err
	}
	res.Report, err = reconcile.Run(ctx, pool, js, rc)
	if err != nil {
		return err
	}
	final := res.Report
	if f.repair {
		todo := res.Report.Missing
		if f.includePending {
			todo = append(append([]reconcile.Event(nil), todo...), res.Report.Pending...)
		}
		if len(todo) > 0 {
			res.Repair, err = reconcile.Repair(ctx, pool, js, reconcile.RepairConfig{Router: cfg.Router, Stream: cfg.NATS.Stream}, todo)
			if err != nil {
				return err
			}
			// Check the result the same way, over the same window.
			rc.Until = res.Report.Until
			if res.After, err = reconcile.Run(ctx, pool, js, rc); err != nil {
				return err
			}
			final = res.After
		}
	}
	if f.metricsFile != "" {
		reg := prometheus.NewRegistry()
		m := metrics.NewReconcile(reg)
		m.Reconciled(final, nil)
		m.Repaired(res.Repair)
		if err := prometheus.WriteToTextfile(f.metricsFile, reg); err != nil {
			return fmt.Errorf("write %s: %w", f.metricsFile, err)
		}
	}
	if err := writeReconcile(out, cfg, res, f, rc.Since); err != nil {
		return err
	}
	if final.Total.Missing > 0 || final.Total.Pending > 0 || final.Total.SharedID > 0 {
		return exitCode(1)
	}
	return nil
}

// writeReconcile prints the reconciliation, as JSON with --json.
func writeReconcile(out io.Writer, cfg config.Config, res reconcileOutput, f reconcileFlags, since time.Time) error {
	if f.asJSON {
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		return enc.Encode(res)
	}
	printReconcile(out, cfg, res.Report, f.list)
	if res.Repair != nil {
		printRepair(out, cfg, res.Repair)
		fmt.Fprintln(out)
		fmt.Fprintln(out, "After the repair:")
		printReconcile(out, cfg, res.After, f.list)
	}
	if res.PublicationGap != nil {
		printReconcileGap(out, res.PublicationGap, since)
	}
	return nil
}

func printReconcile(w io.Writer, cfg config.Config, r *reconcile.Report, list int) {
	fmt.Fprintf(w, "Outbox rows with occurred_at in [%s, %s) against stream %s\n", r.Since.Format(time.RFC3339), r.Until.Format(time.RFC3339), cfg.NATS.Stream)
	switch {
	case r.Confirmed && r.ConfirmedLSN == "":
		fmt.Fprintf(w, "  every row read is in the stream or the dead-letter stream\n")
	case r.Confirmed:
		fmt.Fprintf(w, "  slot %s confirmed %s, past the snapshot's %s: every row read had been relayed\n", cfg.Postgres.Slot, r.ConfirmedLSN, r.SnapshotLSN)
	case r.ConfirmedLSN == "":
		fmt.Fprintf(w, "  slot %s does not exist: rows not in the stream are pending, not missing (run the relay, or --repair --include-pending)\n", cfg.Postgres.Slot)
	default:
		fmt.Fprintf(w, "  slot %s confirmed only %s, before the snapshot's %s: rows not in the stream are pending (is the relay running? --confirm-wait waits longer)\n", cfg.Postgres.Slot, r.ConfirmedLSN, r.SnapshotLSN)
	}
	fmt.Fprintf(w, "  read %d events and %d dead letters in %s\n", r.StreamMessages, r.DeadLetterMessages, r.Duration.Round(time.Millisecond))
	if len(r.Tableless) > 0 {
		fmt.Fprintf(w, "  not checked: the table-less events of message prefixes %s have no rows to compare with (their events in the stream are not reported either)\n", strings.Join(r.Tableless, ", "))
	}
	if r.FoundBySubject > 0 {
		fmt.Fprintf(w, "  %d rows were found only by looking their subjects up: their events were stored before the window's start (rows dated ahead of their commit)\n", r.FoundBySubject)
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "TABLE\tAGGREGATE TYPE\tROWS\tIN STREAM\tMISSING\tPENDING\tDEAD-LETTERED\tEXPIRED\tUNEXPECTED\tDUPLICATES\t")
	row := func(g reconcile.Group) {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t\n", g.Table, g.AggregateType, g.Rows, g.InStream, g.Missing, g.Pending, g.DeadLettered, g.Expired, g.Unexpected, g.Duplicates)
	}
	for _, g := range r.Groups {
		row(g)
	}
	t := r.Total
	t.Table, t.AggregateType = "total", ""
	row(t)
	_ = tw.Flush()
	listEvents(w, "missing", r.Missing, r.Total.Missing, list)
	listEvents(w, "pending", r.Pending, r.Total.Pending, list)
	listEvents(w, "dead-lettered (see `outbox-relay dlq list`)", r.DeadLettered, r.Total.DeadLettered, list)
	listEvents(w, "unexpected", r.Unexpected, r.Total.Unexpected, list)
	if r.Total.SharedID > 0 {
		fmt.Fprintf(w, "\n%d rows share their event id with another row of the same table (a partitioned table's unique constraints hold per partition only): consumers keep one event per id, so one fact is lost. Give each its own id.\n", r.Total.SharedID)
		listEvents(w, "sharing an event id", r.SharedID, r.Total.SharedID, list)
	}
	for table, n := range r.NoOccurredAt {
		fmt.Fprintf(w, "\n%s: %d rows have a NULL occurred_at: no window selects them, so they are never reconciled nor cleaned up. Set it (and add NOT NULL).\n", table, n)
	}
	if r.Total.NoEventID > 0 {
		fmt.Fprintf(w, "\n%d rows have a NULL event id: nothing can match them with an event, and the relay dead-letters them (`outbox-relay dlq --relay list`). Fix the producer (and add NOT NULL to the column), insert each event again with an id and delete the row without one.\n", r.Total.NoEventID)
		listEvents(w, "without an event id", r.NoEventID, r.Total.NoEventID, list)
	}
	if r.Total.Expired > 0 {
		fmt.Fprintf(w, "\n%d rows dated before %s are not in the stream, whose limits (max_age, max_msgs, max_bytes) removed the events stored before its first message: they cannot be checked and --repair never republishes them (consumers may have applied and forgotten them). Reconcile a later window, or clean these rows up.\n", r.Total.Expired, r.ExpiredBefore.Format(time.RFC3339))
		listEvents(w, "expired", r.Expired, r.Total.Expired, list)
	}
	if r.Total.Missing > 0 {
		fmt.Fprintln(w, "\n`outbox-relay reconcile --repair` with the same window republishes the missing events.")
	}
}

func listEvents(w io.Writer, what string, evs []reconcile.Event, total, limit int) {
	if total == 0 || limit <= 0 {
		return
	}
	shown := min(len(evs), limit)
	fmt.Fprintf(w, "\n%s: %d", strings.ToUpper(what[:1])+what[1:], total)
	if shown < total {
		fmt.Fprintf(w, " (first %d)", shown)
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, e := range evs[:shown] {
		seq := ""
		if e.StreamSeq > 0 {
			seq = fmt.Sprintf("seq %d", e.StreamSeq)
		}
		fmt.Fprintf(tw, "  %s\t%s\t%q\tv%s\t%s\t%s\t%s\n", e.Table, e.AggregateType, e.AggregateID, e.AggregateVersion, e.EventID, e.OccurredAt.Format(time.RFC3339), seq)
	}
	_ = tw.Flush()
}

func printRepair(w io.Writer, cfg config.Config, r *reconcile.RepairReport) {
	fmt.Fprintf(w, "\nRepair: %d republished, %d acknowledged as duplicates, %d already in the stream (not republished), %d rows gone, %d failed\n", r.Published, r.Duplicates, r.AlreadyInStream, r.Gone, len(r.Failed))
	if r.Duplicates > 0 {
		fmt.Fprintf(w, "  The stream still holds the ids of %d events in its duplicate window (nats.duplicate_window %s) and dropped them: rerun after the window passed.\n", r.Duplicates, cfg.NATS.DuplicateWindow)
		if r.HeldBehindDuplicates > 0 {
			fmt.Fprintf(w, "  %d later events of their aggregates were held back to keep each aggregate's order; the rerun republishes them too.\n", r.HeldBehindDuplicates)
		}
	}
	for i, f := range r.Failed {
		if i == 20 {
			fmt.Fprintf(w, "  ... %d more (--json lists all)\n", len(r.Failed)-i)
			break
		}
		fmt.Fprintf(w, "  %s %s %q v%s %s: %s\n", f.Event.Table, f.Event.AggregateType, f.Event.AggregateID, f.Event.AggregateVersion, f.Event.EventID, f.Reason)
	}
}
