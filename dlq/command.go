package dlq

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// RelayOwnerKey is the key of the relay's dead-letter queue in Deps.Owners.
const RelayOwnerKey = "relay"

// Deps is what the dlq command needs from the program that mounts it. The
// command reads no environment variables: pass defaults in here.
type Deps struct {
	// User is the default --actor recorded in the audit trail (main passes
	// $USER).
	User string
	// ConsumerDatabaseURL is the default --consumer-db: the PostgreSQL
	// database holding a consumer's consumer_dead_letter table.
	ConsumerDatabaseURL string
	// ConnectDatabase opens the consumer database. Default pgxpool.New.
	ConnectDatabase func(ctx context.Context, url string) (*pgxpool.Pool, error)
	// ConnectNATS connects to the NATS server of the relay's dead-letter
	// stream (with --relay), typically from the relay's configuration.
	// The command closes the connection when it is done.
	ConnectNATS func(ctx context.Context) (*nats.Conn, error)
	// RelayTarget names the relay's dead-letter stream (and how an audit
	// stream it creates is replicated), typically from the relay's
	// configuration; it is called with --relay unless --relay-stream is
	// given. Nil leaves RelayStream.
	RelayTarget func() (RelayTarget, error)
	// RelayStream, AuditStream and AuditSubject name the relay's
	// dead-letter stream and the stream auditing actions on it. Defaults
	// DefaultRelayStream, DefaultAuditStream, DefaultAuditSubject.
	RelayStream  string
	AuditStream  string
	AuditSubject string
	// Owners maps a dead-letter queue (a consumer name, or RelayOwnerKey)
	// to who must act on it; shown in listings. A consumer's records also
	// carry the owner its configuration names, which an entry here
	// overrides.
	Owners map[string]string
	// Now is the clock. Default time.Now.
	Now func() time.Time
}

// flags shared by the subcommands.
type cmdState struct {
	deps       Deps
	consumerDB string
	relay      bool
	relayStrm  string
	actor      string
	output     string
}

// NewCommand returns the `dlq` command with subcommands list, show, replay,
// discard and audit. They act on consumers' dead letters (the
// consumer_dead_letter table of --consumer-db) or, with --relay, on the
// relay's dead-letter stream. Mount it under the relay's root command:
//
//	root.AddCommand(dlq.NewCommand(dlq.Deps{
//		User:                os.Getenv("USER"),
//		ConsumerDatabaseURL: os.Getenv("OUTBOX_DLQ_CONSUMER_DB"),
//		ConnectNATS:         func(ctx context.Context) (*nats.Conn, error) { return nats.Connect(natsURL) },
//		Owners:              map[string]string{"relay": "platform-team"},
//	}))
func NewCommand(deps Deps) *cobra.Command {
	if deps.Now == nil {
		deps.Now = time.Now
	}
	if deps.ConnectDatabase == nil {
		deps.ConnectDatabase = pgxpool.New
	}
	st := &cmdState{deps: deps}
	root := &cobra.Command{
		Use:   "dlq",
		Short: "List, show, replay, discard and audit dead letters",
		Long: `Dead letters are messages that could not be processed. Consumers keep theirs in the
consumer_dead_letter table of their own database (--consumer-db); the relay keeps rows it could
not route in its dead-letter stream (--relay). Every replay and discard is audited with the
actor (--actor, default $USER) and the reason; see "dlq audit".`,
		SilenceUsage: true,
	}
	pf := root.PersistentFlags()
	pf.StringVar(&st.consumerDB, "consumer-db", deps.ConsumerDatabaseURL, "PostgreSQL URL of the consumer database holding consumer_dead_letter")
	pf.BoolVar(&st.relay, "relay", false, "act on the relay's dead-letter stream instead of a consumer's table")
	pf.StringVar(&st.relayStrm, "relay-stream", "", "the relay's dead-letter stream (default: the configuration's nats.dead_letter_stream, else "+orDefault(deps.RelayStream, DefaultRelayStream)+")")
	pf.StringVar(&st.actor, "actor", deps.User, "who performs replays and discards, for the audit trail")
	pf.StringVarP(&st.output, "output", "o", "text", "output format: text or json")
	root.AddCommand(st.listCmd(), st.showCmd(), st.replayCmd(), st.discardCmd(), st.auditCmd())
	return root
}

func orDefault(v, def string) string {
	if v == "" {
		return def
	}
	return v
}

// store opens the consumer database.
func (st *cmdState) store(ctx context.Context) (*Store, func(), error) {
	if st.consumerDB == "" {
		return nil, nil, fmt.Errorf("%w: set --consumer-db to the consumer's database URL (or use --relay)", ErrUsage)
	}
	pool, err := st.deps.ConnectDatabase(ctx, st.consumerDB)
	if err != nil {
		return nil, nil, fmt.Errorf("connect to the consumer database: %w", err)
	}
	s := NewStore(pool)
	s.now = st.deps.Now
	return s, pool.Close, nil
}

// relayDLQ connects to the relay's dead-letter stream.
func (st *cmdState) relayDLQ(ctx context.Context) (*RelayDLQ, func(), error) {
	if st.deps.ConnectNATS == nil {
		return nil, nil, fmt.Errorf("%w: this program does not know how to reach the relay's NATS server", ErrNotSupported)
	}
	nc, err := st.deps.ConnectNATS(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("connect to NATS: %w", err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, fmt.Errorf("jetstream: %w", err)
	}
	target := RelayTarget{Stream: st.deps.RelayStream}
	if st.deps.RelayTarget != nil {
		// The configuration's stream, not a default: another service's
		// dead letters may be in OUTBOX_DLQ.
		if target, err = st.deps.RelayTarget(); err != nil {
			nc.Close()
			return nil, nil, err
		}
	}
	if st.relayStrm != "" {
		target.Stream = st.relayStrm
	}
	r := NewRelayDLQ(js, target.Stream, st.deps.AuditStream, st.deps.AuditSubject)
	r.auditReplicas = target.AuditReplicas
	r.now = st.deps.Now
	return r, nc.Close, nil
}

func (st *cmdState) owner(queue, recorded string) string {
	if o := st.deps.Owners[queue]; o != "" {
		return o
	}
	if recorded != "" {
		return recorded
	}
	return "(no owner)"
}

func (st *cmdState) listCmd() *cobra.Command {
	var (
		f        Filter
		rf       RelayFilter
		statuses string
	)
	c := &cobra.Command{
		Use:   "list",
		Short: "List dead letters (open ones by default)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			if st.relay {
				r, closeFn, err := st.relayDLQ(ctx)
				if err != nil {
					return err
				}
				defer closeFn()
				rf.Class, rf.OlderThan, rf.NewerThan, rf.Limit = f.Class, f.OlderThan, f.NewerThan, f.Limit
				recs, err := r.List(ctx, rf)
				if err != nil {
					return err
				}
				return st.printRelayList(cmd.OutOrStdout(), r.Stream(), recs)
			}
			if statuses != "" {
				f.Statuses = strings.Split(statuses, ",")
			}
			s, closeFn, err := st.store(ctx)
			if err != nil {
				return err
			}
			defer closeFn()
			recs, err := s.List(ctx, f)
			if err != nil {
				return err
			}
			return st.printList(cmd.OutOrStdout(), recs)
		},
	}
	fl := c.Flags()
	fl.StringVar(&f.Consumer, "consumer", "", "only this consumer's dead letters")
	fl.StringVar(&f.Class, "class", "", "only this failure class (consumers: permanent, unknown, transient, conflict, gap; relay: its reason classes)")
	fl.StringVar(&statuses, "status", "", "comma-separated statuses (open, replaying, replayed, discarded) or all; default open,replaying")
	fl.DurationVar(&f.OlderThan, "older-than", 0, "only dead letters older than this age (e.g. 1h)")
	fl.DurationVar(&f.NewerThan, "newer-than", 0, "only dead letters younger than this age")
	fl.StringVar(&rf.Table, "table", "", "relay: only records of this outbox table")
	fl.IntVar(&f.Limit, "limit", 200, "at most this many records (0: all)")
	return c
}

func (st *cmdState) showCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "show ID",
		Short: "Show one dead letter with its headers and payload (with --relay: its stream sequence)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			if st.relay {
				seqs, err := parseSeqs(args)
				if err != nil {
					return err
				}
				r, closeFn, err := st.relayDLQ(ctx)
				if err != nil {
					return err
				}
				defer closeFn()
				rec, err := r.Get(ctx, seqs[0])
				if err != nil {
					return err
				}
				return st.printRelayRecord(cmd.OutOrStdout(), r.Stream(), rec)
			}
			ids, err := parseIDs(args)
			if err != nil {
				return err
			}
			s, closeFn, err := st.store(ctx)
			if err != nil {
				return err
			}
			defer closeFn()
			rec, err := s.Get(ctx, ids[0])
			if err != nil {
				return err
			}
			return st.printRecord(cmd.OutOrStdout(), rec)
		},
	}
}

func (st *cmdState) replayCmd() *cobra.Command {
	var (
		sel     selection
		reason  string
		noWait  bool
		timeout time.Duration
		poll    time.Duration
	)
	c := &cobra.Command{
		Use:   "replay [ID...]",
		Short: "Hand dead letters back to the consumer that failed them, in aggregate order",
		Long: `Marks the selected open dead letters for replay. Each is applied again by the consumer
named in the record, and only by it, through the same idempotent transaction as a live
message (the event id is kept, so an event already applied is not applied twice); the
records of one aggregate are replayed in version order, and a failure holds back the
aggregate's later records. The consumer must be running. The command waits and shows
progress unless --no-wait is given.

Select records by id, or with --consumer and filters (--class, --older-than) or --all.`,
		RunE: func(cmd *cobra.Command, args []string) error {
			if st.relay {
				return fmt.Errorf("%w: relay dead letters are rows the relay could not route; fix the row in place (UPDATE) or the relay configuration, discard the record, then run outbox-relay reconcile --since <its time> --repair, which republishes it from the row with its event id (do not insert a second row: the original would be repaired too, two events for one fact)", ErrNotSupported)
			}
			f, err := sel.filter(args)
			if err != nil {
				return err
			}
			if st.actor == "" {
				// Before the database: its error would hide this one.
				return ErrActorRequired
			}
			ctx := cmd.Context()
			s, closeFn, err := st.store(ctx)
			if err != nil {
				return err
			}
			defer closeFn()
			t, err := s.RequestReplay(ctx, Action{Actor: st.actor, Reason: reason}, f)
			if err != nil {
				return err
			}
			out := cmd.ErrOrStderr()
			fmt.Fprintf(out, "replay %s: %d dead letter(s) handed back to their consumer(s)\n", t.Token, len(t.IDs))
			if noWait {
				return nil
			}
			return st.waitReplay(ctx, out, s, t, timeout, poll)
		},
	}
	fl := c.Flags()
	sel.register(fl, "replay")
	fl.StringVar(&reason, "reason", "", "why the dead letters can be replayed now (recorded in the audit trail)")
	fl.BoolVar(&noWait, "no-wait", false, "return after handing the records back, without waiting for the consumer")
	fl.DurationVar(&timeout, "timeout", 10*time.Minute, "how long to wait for the consumer to replay everything")
	fl.DurationVar(&poll, "poll", 500*time.Millisecond, "how often to check the replay's progress")
	return c
}

// waitReplay polls the replay's progress, printing it when it changes and
// at least every 5 seconds, until every record is done or timeout passes.
func (st *cmdState) waitReplay(ctx context.Context, out io.Writer, s *Store, t Ticket, timeout, poll time.Duration) error {
	deadline := time.Now().Add(timeout)
	var last Progress
	lastPrint := time.Time{}
	tick := time.NewTicker(poll)
	defer tick.Stop()
	for {
		p, err := s.ReplayProgress(ctx, t)
		if err != nil {
			return err
		}
		if p != last || time.Since(lastPrint) >= 5*time.Second {
			fmt.Fprintf(out, "replay %s: %d/%d done (%d applied, %d duplicate, %d rejected, %d failed again, %d changed by others), %d waiting\n",
				t.Token, p.Total-p.Waiting, p.Total, p.Applied, p.Duplicate, p.Rejected, p.Failed, p.Other, p.Waiting)
			last, lastPrint = p, time.Now()
		}
		switch {
		case p.Done() && p.Failed > 0:
			return fmt.Errorf("%w: %d of %d dead letters failed again and are open with the new reason (dlq list)", ErrReplayIncomplete, p.Failed, p.Total)
		case p.Done():
			return nil
		case time.Now().After(deadline):
			return fmt.Errorf("%w: %d of %d dead letters still wait for their consumer after %s; is it running? They stay marked for replay and are applied when it runs",
				ErrReplayIncomplete, p.Waiting, p.Total, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
	}
}

func (st *cmdState) discardCmd() *cobra.Command {
	var (
		sel    selection
		reason string
	)
	c := &cobra.Command{
		Use:   "discard ID... --reason TEXT",
		Short: "Close dead letters without applying them (audited; --reason required)",
		Long: `Closes the selected open dead letters without applying them. --reason is required and
recorded with the actor in the audit trail. Consumer records stay in their table with status
"discarded"; in the same transaction the event is recorded in consumed_message with outcome
"discarded" (a redelivery is then a duplicate, never applied), and an aggregate whose
version-check position stands just before the discarded version is moved past it (VersionCheck
consumers then apply the later versions; they also skip discarded versions they find missing).
Relay records (--relay, by stream sequence) are deleted from the stream after the audit entry
is stored.`,
		RunE: func(cmd *cobra.Command, args []string) error {
			if strings.TrimSpace(reason) == "" {
				return fmt.Errorf("%w: say why the dead letters may be dropped (--reason)", ErrReasonRequired)
			}
			if st.actor == "" {
				return ErrActorRequired
			}
			ctx := cmd.Context()
			act := Action{Actor: st.actor, Reason: reason}
			if st.relay {
				seqs, err := parseSeqs(args)
				if err != nil {
					return err
				}
				r, closeFn, err := st.relayDLQ(ctx)
				if err != nil {
					return err
				}
				defer closeFn()
				if err := r.Discard(ctx, act, seqs); err != nil {
					return err
				}
				fmt.Fprintf(cmd.OutOrStdout(), "discarded %d relay dead letter(s) from %s\n", len(seqs), r.Stream())
				return nil
			}
			f, err := sel.filter(args)
			if err != nil {
				return err
			}
			s, closeFn, err := st.store(ctx)
			if err != nil {
				return err
			}
			defer closeFn()
			done, err := s.Discard(ctx, act, f)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "discarded %d dead letter(s): %s\n", len(done), joinIDs(done))
			return nil
		},
	}
	fl := c.Flags()
	fl.StringVar(&reason, "reason", "", "why the dead letters may be dropped (required)")
	sel.register(fl, "discard")
	return c
}

func (st *cmdState) auditCmd() *cobra.Command {
	var f AuditFilter
	c := &cobra.Command{
		Use:   "audit",
		Short: "Show who replayed or discarded which dead letters, when and why",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			var entries []AuditEntry
			if st.relay {
				r, closeFn, err := st.relayDLQ(ctx)
				if err != nil {
					return err
				}
				defer closeFn()
				if entries, err = r.Audit(ctx, f); err != nil {
					return err
				}
			} else {
				s, closeFn, err := st.store(ctx)
				if err != nil {
					return err
				}
				defer closeFn()
				if entries, err = s.Audit(ctx, f); err != nil {
					return err
				}
			}
			return st.printAudit(cmd.OutOrStdout(), entries)
		},
	}
	c.Flags().StringVar(&f.Consumer, "consumer", "", "only this consumer's entries")
	c.Flags().DurationVar(&f.Since, "since", 0, "only entries younger than this age (e.g. 24h)")
	c.Flags().IntVar(&f.Limit, "limit", 200, "at most the latest this many entries (0: all)")
	return c
}

// selection is how replay and discard choose consumer records: by id, or
// by consumer with --all or filters.
type selection struct {
	f   Filter
	all bool
}

func (sel *selection) register(fl *pflag.FlagSet, verb string) {
	fl.StringVar(&sel.f.Consumer, "consumer", "", verb+" this consumer's dead letters")
	fl.StringVar(&sel.f.Class, "class", "", "only this failure class")
	fl.DurationVar(&sel.f.OlderThan, "older-than", 0, "only dead letters older than this age")
	fl.DurationVar(&sel.f.NewerThan, "newer-than", 0, "only dead letters younger than this age")
	fl.BoolVar(&sel.all, "all", false, "with --consumer: every open dead letter of the consumer")
}

// filter combines the ids in args with the flags, refusing a selection
// that names nothing, so that a bare command never acts on everything.
func (sel *selection) filter(args []string) (Filter, error) {
	ids, err := parseIDs(args)
	if err != nil {
		return Filter{}, err
	}
	f := sel.f
	f.IDs = ids
	filtered := sel.all || f.Class != "" || f.OlderThan > 0 || f.NewerThan > 0
	if len(ids) == 0 && (f.Consumer == "" || !filtered) {
		return Filter{}, fmt.Errorf("%w: name record ids, or --consumer with --all or a filter (--class, --older-than, --newer-than)", ErrUsage)
	}
	return f, nil
}

func parseIDs(args []string) ([]int64, error) {
	ids := make([]int64, 0, len(args))
	for _, a := range args {
		n, err := strconv.ParseInt(a, 10, 64)
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("%w: %q is not a dead-letter id", ErrUsage, a)
		}
		ids = append(ids, n)
	}
	return ids, nil
}

func joinIDs(ids []int64) string {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = strconv.FormatInt(id, 10)
	}
	return strings.Join(s, ", ")
}

// IsUsageError reports whether err is a command-line mistake (exit status 2
// is customary) rather than a failure.
func IsUsageError(err error) bool {
	return errors.Is(err, ErrUsage) || errors.Is(err, ErrReasonRequired) || errors.Is(err, ErrActorRequired)
}
