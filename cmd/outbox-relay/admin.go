package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/provision"
	"github.com/outbox-relay/outbox-relay/replication"
)

func newSetupCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "setup",
		Short: "Create the streams, the publication and the replication slot (idempotent)",
		Long: "Checks PostgreSQL first, changing nothing (the connection, wal_level, the role,\n" +
			"the tables, whether this role may create or extend the publication), then\n" +
			"creates what is missing, in this order, and prints each step as it is done:\n" +
			"the event and dead-letter streams (a stream whose subjects do not cover the\n" +
			"configuration stops setup before PostgreSQL is changed), then the publication,\n" +
			"then the slot, last, because a slot retains WAL from the moment it exists; with\n" +
			"postgres.backfill the slot comes with an exported snapshot and the rows already\n" +
			"waiting are published. A setup that fails removes the streams it created while\n" +
			"they are empty, and says what it left.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := g.load()
			if err != nil {
				return err
			}
			// Backfilling a large outbox can take a while: SIGINT stops it.
			ctx, cancel := signalContext()
			defer cancel()
			// PostgreSQL first, changing nothing: a refusal found after the
			// streams existed (a wrong password, a missing table) left them
			// behind, and with backfill a record of an interrupted one.
			if err := replication.Preflight(ctx, cfg.Replication()); err != nil {
				return fmt.Errorf("%w; setup changed nothing", causeFirst{err})
			}
			nc, err := connectNATS(cfg.NATS, zap.NewNop(), "outbox-relay setup")
			if err != nil {
				return fmt.Errorf("%w; setup changed nothing", err)
			}
			defer nc.Close()
			js, err := jetstream.New(nc)
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			created, err := setupStreams(ctx, js, cfg, out)
			if err != nil {
				// PostgreSQL is still unchanged.
				return undoStreams(js, created, fmt.Errorf("%w; PostgreSQL was not changed", err))
			}
			if err := setupPostgres(ctx, cfg, nc, out, cmd.ErrOrStderr()); err != nil {
				return undoStreams(js, created, causeFirst{err})
			}
			// Without backfill an interrupted one stays: say so now, not
			// when run refuses the slot.
			if _, err := replication.CheckBackfill(ctx, cfg.Replication()); errors.Is(err, replication.ErrBackfillIncomplete) {
				return err
			}
			return nil
		},
	}
}

// setupPostgres creates the publication and the slot, with postgres.backfill
// from an exported snapshot whose waiting rows it publishes, printing each
// step.
func setupPostgres(ctx context.Context, cfg config.Config, nc *nats.Conn, out, progress io.Writer) error {
	backfillRows, err := setupBackfills(ctx, cfg, out)
	if err != nil {
		return err
	}
	slotCreated := false
	if backfillRows {
		brep, err := backfill(ctx, cfg, nc, zap.NewNop(), progress)
		if err != nil {
			return err
		}
		for _, a := range brep.Actions {
			fmt.Fprintln(out, "postgres:", a)
		}
		if slotCreated = brep.SlotCreated; slotCreated {
			fmt.Fprintf(out, "postgres: backfilled %d waiting rows (%d dead-lettered, %d skipped: already in stream %s, %d skipped: older than the stream's first message, see reconcile's expired rows)\n", brep.Rows, brep.DeadLettered, brep.AlreadyStreamed, cfg.NATS.Stream, brep.Expired)
		}
	}
	rep, err := replication.Setup(ctx, cfg.Replication())
	if err != nil {
		return err
	}
	if !slotCreated {
		// After a backfill these would only say "already exists"
		// of what it has just created.
		for _, a := range rep.Actions {
			fmt.Fprintln(out, "postgres:", a)
		}
	}
	return nil
}

// setupBackfills reports whether setup backfills the slot: with
// postgres.backfill, unless the server is a standby. A standby is read-only:
// the backfill's record (replication.BackfillTable), which guards against
// streaming past an interrupted backfill, cannot be written there, so setup
// creates the standby's slot without one and says what it leaves undone.
func setupBackfills(ctx context.Context, cfg config.Config, out io.Writer) (bool, error) {
	if !cfg.Postgres.Backfill {
		return false, nil
	}
	info, err := replication.ReadServer(ctx, cfg.Replication())
	if err != nil {
		return false, err
	}
	if !info.InRecovery {
		return true, nil
	}
	fmt.Fprintf(out, "postgres: the server is a standby (in recovery, read-only): no backfill, and no %s record written; "+
		"the rows already in the outbox are not published by this setup, only those committed after the standby's slot is created; "+
		"backfill them by running setup against the primary first (docs/operations.md, \"Decoding on a standby\"), "+
		"or publish them with `outbox-relay reconcile --repair` once the relay runs\n", replication.BackfillTable)
	return false, nil
}

// setupStreams creates the event and dead-letter streams that are missing
// and checks those that exist, printing each. It returns the names of the
// streams it created, also when it fails.
func setupStreams(ctx context.Context, js jetstream.JetStream, cfg config.Config, out io.Writer) ([]string, error) {
	var created []string
	events, dlq := cfg.Streams()
	events.UpdatePartitions = true // setup is where the partition count is set or changed
	for _, spec := range []provision.StreamSpec{events, dlq} {
		srep, err := provision.EnsureStream(ctx, js, spec, true)
		if err != nil {
			return created, err
		}
		if srep.Created {
			created = append(created, spec.Name)
			fmt.Fprintf(out, "nats: created stream %s (subjects %v, file storage, duplicate window %s)\n", spec.Name, spec.Subjects, spec.Duplicates)
		} else {
			fmt.Fprintf(out, "nats: stream %s already exists (subjects %v)\n", spec.Name, srep.Info.Config.Subjects)
		}
		if srep.Partitioned {
			fmt.Fprintf(out, "nats: stream %s now partitioned into %d (subject transform %s -> %s)\n", spec.Name, spec.Partitions, srep.Info.Config.SubjectTransform.Source, srep.Info.Config.SubjectTransform.Destination)
		}
		for _, w := range srep.Warnings {
			fmt.Fprintln(out, "warning:", w)
		}
	}
	return created, nil
}

// undoStreams deletes the streams a failed setup created while they are
// still empty, so that it leaves nothing behind, and adds to err what it
// removed and what it had to leave.
func undoStreams(js jetstream.JetStream, created []string, err error) error {
	if len(created) == 0 {
		return err
	}
	// A fresh context: the setup's may be what ended (SIGINT).
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var removed, left []string
	for _, name := range created {
		n, derr := deleteIfEmpty(ctx, js, name)
		switch {
		case derr == nil:
			removed = append(removed, name)
		case n > 0:
			left = append(left, fmt.Sprintf("%s (%d messages: setup again resumes with them)", name, n))
		default:
			left = append(left, fmt.Sprintf("%s (%v)", name, derr))
		}
	}
	msg := ""
	if len(removed) > 0 {
		msg = fmt.Sprintf("; setup removed the streams it had created (%s)", strings.Join(removed, ", "))
	}
	if len(left) > 0 {
		msg += fmt.Sprintf("; setup left the streams it had created: %s; remove one with `nats stream rm NAME`", strings.Join(left, ", "))
	}
	return fmt.Errorf("%w%s", err, msg)
}

// deleteIfEmpty deletes the stream unless it holds messages, whose count it
// then returns with an error.
func deleteIfEmpty(ctx context.Context, js jetstream.JetStream, name string) (uint64, error) {
	s, err := js.Stream(ctx, name)
	if err != nil {
		return 0, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0, err
	}
	if info.State.Msgs > 0 {
		return info.State.Msgs, errors.New("not empty")
	}
	return 0, js.DeleteStream(ctx, name)
}

// statusReport is what `status --json` prints.
type statusReport struct {
	Slot              string `json:"slot"`
	SlotExists        bool   `json:"slot_exists"`
	SlotActive        bool   `json:"slot_active"`
	SlotActivePID     int32  `json:"slot_active_pid,omitempty"`
	WALStatus         string `json:"wal_status,omitempty"`
	ConfirmedFlushLSN string `json:"confirmed_flush_lsn,omitempty"`
	RetainedWALBytes  int64  `json:"retained_wal_bytes"`
	LagBytes          int64  `json:"lag_bytes"`
	// BackfillIncomplete: the slot's backfill was interrupted.
	BackfillIncomplete bool `json:"backfill_incomplete,omitempty"`
	// PublicationGap is the slot's recorded publication gap, if any.
	PublicationGap *gapStatus `json:"publication_gap,omitempty"`
	Stream         string     `json:"stream"`
	StreamMessages uint64     `json:"stream_messages"`
	StreamLastSeq  uint64     `json:"stream_last_seq"`
	StreamStorage  string     `json:"stream_storage,omitempty"`
	StreamReplicas int        `json:"stream_replicas,omitempty"`
	// DurableAcks says whether the event stream's acks survive a server
	// crash; DurableReason says why not.
	DurableAcks      *bool  `json:"durable_acks,omitempty"`
	DurableReason    string `json:"durable_reason,omitempty"`
	DeadLetterStream string `json:"dead_letter_stream"`
	DeadLetters      uint64 `json:"dead_letters"`
	// DeadLetterOldestAge is the age of the oldest dead letter; 0 when none.
	DeadLetterOldestAge float64 `json:"dead_letter_oldest_age_seconds"`
	// Relay holds a running relay's in-memory figures, scraped from
	// http.listen; RelayUnreachable says why they are missing.
	Relay            *relayFigures `json:"relay,omitempty"`
	RelayUnreachable string        `json:"relay_unreachable,omitempty"`
	// Failover says whether promoting a standby now would keep the slot.
	Failover *replication.FailoverReport `json:"failover,omitempty"`
	// PostgresError and NATSError say why the slot's or the streams' fields
	// are unknown (then they hold zero values, not findings).
	PostgresError string   `json:"postgres_error,omitempty"`
	NATSError     string   `json:"nats_error,omitempty"`
	Problems      []string `json:"problems,omitempty"`
	// Warnings are worth knowing and do not make status exit 1: a risk
	// that no setting removes (a failover on PostgreSQL 16 or older).
	Warnings []string `json:"warnings,omitempty"`
}

// relayFigures are a running relay's figures from its /metrics.
type relayFigures struct {
	URL   string `json:"url"`
	Ready bool   `json:"ready"`
	// Standby: not streaming, and a healthy standby (/readyz?standby=ok):
	// NATS connected, another instance holds the slot.
	Standby          bool    `json:"standby,omitempty"`
	InFlight         float64 `json:"in_flight_messages"`
	OldestUnackedAge float64 `json:"oldest_unacked_age_seconds"`
	// LastRelayedCommit is the end of the newest transaction this session
	// relayed and had acknowledged (outbox_relay_confirmed_lsn). An idle
	// relay confirms the server's WAL end to the slot, so the slot's
	// confirmed_flush_lsn is often past it: that is not lag.
	LastRelayedCommit    string  `json:"last_relayed_commit_lsn"`
	EventsPublished      float64 `json:"events_published_total"`
	Duplicates           float64 `json:"publish_duplicates_total"`
	DeadLettered         float64 `json:"dead_lettered_total"`
	Retries              float64 `json:"publish_retries_total"`
	ReplicationRestarts  float64 `json:"replication_restarts_total"`
	ReconcileMissing     float64 `json:"reconcile_missing_events"`
	ReconcileUnexpected  float64 `json:"reconcile_unexpected_events"`
	ReconcileLastSuccess float64 `json:"reconcile_last_success_timestamp_seconds,omitempty"`
}

// scrapeRelay reads the figures of a relay running with this
// configuration's http.listen.
func scrapeRelay(ctx context.Context, listen string) (*relayFigures, string) {
	if listen == "" {
		return nil, "http.listen is empty"
	}
	host, port, err := net.SplitHostPort(listen)
	if err != nil {
		return nil, err.Error()
	}
	switch host {
	case "", "0.0.0.0":
		host = "127.0.0.1"
	case "::":
		host = "::1"
	}
	url := "http://" + net.JoinHostPort(host, port) + "/metrics"
	sctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	m, err := metrics.Scrape(sctx, http.DefaultClient, url)
	if err != nil {
		return nil, err.Error() + " (is the relay running on this host?)"
	}
	ready := m["outbox_relay_ready"] == 1
	return &relayFigures{
		URL:                  url,
		Ready:                ready,
		Standby:              !ready && standingBy(sctx, "http://"+net.JoinHostPort(host, port)+"/readyz?standby=ok"),
		InFlight:             m["outbox_relay_in_flight_messages"],
		OldestUnackedAge:     m["outbox_relay_oldest_unacked_age_seconds"],
		LastRelayedCommit:    replication.LSN(uint64(m["outbox_relay_confirmed_lsn"])).String(),
		EventsPublished:      m["outbox_relay_events_published_total"],
		Duplicates:           m["outbox_relay_publish_duplicates_total"],
		DeadLettered:         m["outbox_relay_dead_lettered_total"],
		Retries:              m["outbox_relay_publish_retries_total"],
		ReplicationRestarts:  m["outbox_relay_replication_restarts_total"],
		ReconcileMissing:     m["outbox_relay_reconcile_missing_events"],
		ReconcileUnexpected:  m["outbox_relay_reconcile_unexpected_events"],
		ReconcileLastSuccess: m["outbox_relay_reconcile_last_success_timestamp_seconds"],
	}, ""
}

// standingBy asks the relay's /readyz?standby=ok, which answers 200 while
// it is a healthy standby.
func standingBy(ctx context.Context, url string) bool {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return false
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return false
	}
	_ = resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

func newStatusCmd(g *globals) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show the slot's position and retained WAL and the streams' sizes",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := g.load()
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 30*time.Second)
			defer cancel()
			rep := collectStatus(ctx, cfg)
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				if err := enc.Encode(rep); err != nil {
					return err
				}
			} else {
				printStatus(cmd.OutOrStdout(), rep)
			}
			if len(rep.Problems) > 0 {
				return exitCode(1)
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON for scripts")
	return cmd
}

func collectStatus(ctx context.Context, cfg config.Config) statusReport {
	rep := statusReport{Slot: cfg.Postgres.Slot, Stream: cfg.NATS.Stream, DeadLetterStream: cfg.NATS.DeadLetterStream}
	rep.Relay, rep.RelayUnreachable = scrapeRelay(ctx, cfg.HTTP.Listen)
	st, err := replication.Status(ctx, cfg.Postgres.URL, cfg.Postgres.Slot)
	if err != nil {
		rep.PostgresError = leadWithCause(err)
		rep.Problems = append(rep.Problems, "postgres: could not tell the slot's state: "+rep.PostgresError)
	} else {
		rep.SlotExists, rep.SlotActive, rep.SlotActivePID = st.Exists, st.Active, st.ActivePID
		rep.WALStatus, rep.RetainedWALBytes, rep.LagBytes = st.WALStatus, st.RetainedBytes, st.LagBytes
		if st.Exists {
			rep.ConfirmedFlushLSN = st.ConfirmedFlushLSN.String()
		} else {
			rep.Problems = append(rep.Problems, missingSlotProblem(ctx, cfg))
		}
		if st.WALStatus == "lost" {
			rep.Problems = append(rep.Problems, "slot is lost (wal_status = 'lost'): events were lost; follow docs/operations.md, \"Recovering after a lost slot\"")
		}
		rep.Failover, rep.Problems, rep.Warnings = failoverStatus(ctx, cfg, rep.Problems, rep.Warnings)
		if err := replication.CheckPublication(ctx, cfg.Replication()); err != nil {
			rep.Problems = append(rep.Problems, "postgres: "+err.Error())
		}
		if bf, err := replication.ReadBackfillState(ctx, cfg.Replication()); err != nil {
			rep.Problems = append(rep.Problems, "postgres: "+err.Error())
		} else if st.Exists && bf.Incomplete() {
			rep.BackfillIncomplete = true
			rep.Problems = append(rep.Problems, fmt.Sprintf("the backfill of the slot started at %s never finished: `run` refuses the slot; run `outbox-relay setup` to backfill again", bf.StartedAt.UTC().Format(time.RFC3339)))
		}
		if gs, err := readGapStatus(ctx, cfg); err != nil {
			rep.Problems = append(rep.Problems, "postgres: "+err.Error())
		} else if gs != nil {
			rep.PublicationGap = gs
			rep.Problems = append(rep.Problems, gs.problem())
		}
	}
	natsUnknown := func(err error) statusReport {
		rep.NATSError = err.Error()
		rep.Problems = append(rep.Problems, "nats: could not tell the streams' state: "+rep.NATSError)
		return rep
	}
	nc, err := connectNATS(cfg.NATS, zap.NewNop(), "outbox-relay status")
	if err != nil {
		return natsUnknown(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return natsUnknown(err)
	}
	s, err := js.Stream(ctx, cfg.NATS.Stream)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound):
		rep.Problems = append(rep.Problems, fmt.Sprintf("stream %s does not exist: run `outbox-relay setup` (or let `run` create it, nats.create_streams)", cfg.NATS.Stream))
	case err != nil:
		return natsUnknown(fmt.Errorf("stream %s: %w", cfg.NATS.Stream, err))
	default:
		info, err := s.Info(ctx)
		if err != nil {
			return natsUnknown(fmt.Errorf("stream %s: %w", cfg.NATS.Stream, err))
		}
		rep.StreamMessages, rep.StreamLastSeq = info.State.Msgs, info.State.LastSeq
		rep.StreamStorage, rep.StreamReplicas = info.Config.Storage.String(), info.Config.Replicas
		durable, reason := provision.Durability(info.Config)
		rep.DurableAcks, rep.DurableReason = &durable, reason
	}
	if s, err := js.Stream(ctx, cfg.NATS.DeadLetterStream); err == nil {
		if info, err := s.Info(ctx); err == nil {
			rep.DeadLetters = info.State.Msgs
			if info.State.Msgs > 0 {
				rep.DeadLetterOldestAge = time.Since(info.State.FirstTime).Seconds()
			}
		}
	} else if !errors.Is(err, jetstream.ErrStreamNotFound) {
		rep.Problems = append(rep.Problems, fmt.Sprintf("stream %s: %v", cfg.NATS.DeadLetterStream, err))
	}
	return rep
}

func printStatus(w io.Writer, r statusReport) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "slot\t%s\n", r.Slot)
	switch {
	case r.PostgresError != "":
		fmt.Fprintf(tw, "  state\tunknown: could not query PostgreSQL (see the problem below)\n")
	default:
		fmt.Fprintf(tw, "  exists\t%v\n", r.SlotExists)
		if r.SlotActive {
			fmt.Fprintf(tw, "  active\ttrue (pid %d)\n", r.SlotActivePID)
		} else {
			fmt.Fprintf(tw, "  active\tfalse\n")
		}
		fmt.Fprintf(tw, "  wal_status\t%s\n", r.WALStatus)
		fmt.Fprintf(tw, "  confirmed_flush_lsn\t%s\n", r.ConfirmedFlushLSN)
		fmt.Fprintf(tw, "  retained WAL\t%s\n", humanBytes(r.RetainedWALBytes))
		fmt.Fprintf(tw, "  behind current WAL\t%s\n", humanBytes(r.LagBytes))
		if g := r.PublicationGap; g != nil {
			fmt.Fprintf(tw, "  publication gap\topen since %s, from %s (see the problem below)\n", g.NoticedAt.UTC().Format(time.RFC3339), g.SinceLSN)
		}
	}
	fmt.Fprintf(tw, "stream\t%s\n", r.Stream)
	switch {
	case r.NATSError != "":
		fmt.Fprintf(tw, "  state\tunknown: could not reach NATS (see the problem below)\n")
	case r.StreamStorage == "":
		fmt.Fprintf(tw, "  state\tdoes not exist\n")
	default:
		fmt.Fprintf(tw, "  messages\t%d (last seq %d, %s, R%d)\n", r.StreamMessages, r.StreamLastSeq, r.StreamStorage, r.StreamReplicas)
		if r.DurableAcks != nil && !*r.DurableAcks {
			fmt.Fprintf(tw, "  durable acks\tno: %s\n", r.DurableReason)
		}
	}
	fmt.Fprintf(tw, "dead-letter stream\t%s\n", r.DeadLetterStream)
	if r.NATSError == "" {
		fmt.Fprintf(tw, "  records\t%d\n", r.DeadLetters)
		if r.DeadLetters > 0 {
			fmt.Fprintf(tw, "  oldest\t%s old\n", time.Duration(r.DeadLetterOldestAge*float64(time.Second)).Round(time.Second))
		}
	} else {
		fmt.Fprintf(tw, "  state\tunknown: could not reach NATS\n")
	}
	if f := r.Relay; f != nil {
		fmt.Fprintf(tw, "relay\t%s\n", f.URL)
		fmt.Fprintf(tw, "  state\t%s\n", relayState(f))
		fmt.Fprintf(tw, "  in flight\t%.0f (oldest unacknowledged %s old)\n", f.InFlight, time.Duration(f.OldestUnackedAge*float64(time.Second)).Round(time.Millisecond))
		if !f.Standby {
			fmt.Fprintf(tw, "  last relayed commit\t%s\n", lastRelayed(f.LastRelayedCommit, r.ConfirmedFlushLSN))
		}
		fmt.Fprintf(tw, "  since start\t%.0f published, %.0f duplicates, %.0f dead-lettered, %.0f retries, %.0f replication restarts\n",
			f.EventsPublished, f.Duplicates, f.DeadLettered, f.Retries, f.ReplicationRestarts)
		if f.ReconcileLastSuccess > 0 {
			fmt.Fprintf(tw, "  last reconcile\t%.0f missing, %.0f unexpected\n", f.ReconcileMissing, f.ReconcileUnexpected)
		}
	} else {
		fmt.Fprintf(tw, "relay\tnot reachable: %s\n", r.RelayUnreachable)
	}
	printFailover(tw, r.Failover)
	_ = tw.Flush()
	for _, p := range r.Warnings {
		fmt.Fprintln(w, "warning:", p)
	}
	for _, p := range r.Problems {
		fmt.Fprintln(w, "problem:", p)
	}
}

// relayState says what a relay on this host is doing.
func relayState(f *relayFigures) string {
	switch {
	case f.Ready:
		return "streaming"
	case f.Standby:
		return "standby, healthy, waiting for the slot (another instance streams from it)"
	default:
		return "not streaming (its log and /readyz say why)"
	}
}

// lastRelayed presents the relay's last relayed commit beside the slot's
// confirmed_flush_lsn: an idle relay confirms the server's WAL end, so the
// slot is usually past the last commit, which is no lag; a slot behind it
// takes it at the next status update.
func lastRelayed(commit, slot string) string {
	c, err := replication.ParseLSN(commit)
	if err != nil || c == 0 {
		return "none yet: no transaction relayed by this session"
	}
	sl, err := replication.ParseLSN(slot)
	switch {
	case err != nil:
		return commit + ", acknowledged"
	case sl >= c:
		return commit + ", acknowledged and confirmed (the slot's confirmed_flush_lsn is at or past it)"
	default:
		return commit + ", acknowledged; the slot confirms it at the next status update"
	}
}

// missingSlotProblem says what to do about a missing slot: run setup,
// unless setup would refuse for a reason it names (wal_level = replica,
// a role without REPLICATION). Problems of the tables and the publication
// are reported by the publication check beside it.
func missingSlotProblem(ctx context.Context, cfg config.Config) string {
	err := replication.Preflight(ctx, cfg.Replication())
	if err == nil || errors.Is(err, replication.ErrTableMissing) || errors.Is(err, replication.ErrPublicationMissing) || errors.Is(err, replication.ErrPublicationMismatch) {
		return "slot does not exist: run `outbox-relay setup`"
	}
	return "slot does not exist, and setup would refuse: " + leadWithCause(err)
}

func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

func newTeardownCmd(g *globals) *cobra.Command {
	var yes bool
	cmd := &cobra.Command{
		Use:   "teardown",
		Short: "Drop the replication slot (requires --yes)",
		Long: "Drops the relay's replication slot so PostgreSQL stops retaining WAL for it.\n" +
			"Events committed after the slot's confirmed position and not yet relayed are\n" +
			"then never relayed. An abandoned slot is worse: it retains WAL until the disk\n" +
			"fills, so tear down slots you no longer use.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if !yes {
				return usageError("teardown drops the replication slot, and events not yet relayed are then lost: re-run with --yes to confirm")
			}
			cfg, err := g.load()
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), 30*time.Second)
			defer cancel()
			dropped, err := replication.DropSlot(ctx, cfg.Replication())
			if err != nil {
				return err
			}
			if dropped {
				fmt.Fprintf(cmd.OutOrStdout(), "dropped slot %s (the publication %s and the streams are left in place)\n", cfg.Postgres.Slot, cfg.Postgres.Publication)
			} else {
				fmt.Fprintf(cmd.OutOrStdout(), "slot %s does not exist; nothing to do\n", cfg.Postgres.Slot)
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&yes, "yes", false, "confirm dropping the slot")
	return cmd
}
