package reconcile

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"
	"golang.org/x/sync/errgroup"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/provision"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/router"
)

// RepairedAtHeader marks an event republished by Repair; its value is the
// time of the repair (RFC 3339, UTC). Such an event has no
// Outbox-Commit-LSN or Outbox-Commit-Time: the WAL that held its commit is
// gone or was never read.
const RepairedAtHeader = "Outbox-Repaired-At"

// Defaults of RepairConfig.
const (
	DefaultRepairWorkers = 8
	// repairChunk is how many rows are read and published at a time: memory
	// stays bounded however many events are missing.
	repairChunk = 1000
	// publishAttempts bounds the attempts per event on transient errors.
	publishAttempts = 5
)

// RepairConfig says where to republish.
type RepairConfig struct {
	// Router is the relay's table mapping.
	Router router.Config
	// Stream is the event stream; every publish expects it.
	Stream string
	// Workers publish different aggregates in parallel; one aggregate's
	// events are published one after the other. Default
	// DefaultRepairWorkers.
	Workers int
}

// RepairFailure is an event Repair could not republish.
type RepairFailure struct {
	Event  Event  `json:"event"`
	Reason string `json:"reason"`
}

// RepairReport is the outcome of Repair.
type RepairReport struct {
	// Published is the events the stream stored.
	Published int `json:"published"`
	// Duplicates is the events the stream acknowledged as duplicates: their
	// id is still in its duplicate window (deleted within the window, or
	// stored meanwhile). Rerun after the window passes if reconcile still
	// reports them missing.
	Duplicates int `json:"duplicates"`
	// HeldBehindDuplicates is the events not republished because an
	// earlier event of their aggregate was acknowledged as a duplicate: it
	// may still be missing, and storing them first would break the
	// aggregate's order. The rerun after the window republishes both.
	HeldBehindDuplicates int `json:"held_behind_duplicates"`
	// Gone is the events whose row was deleted since reconcile read it.
	Gone int `json:"gone"`
	// AlreadyInStream is the events not republished because a look-up of
	// their subjects found them in the stream (stored before the window the
	// reconcile scan read, e.g. a row dated ahead of its commit).
	AlreadyInStream int `json:"already_in_stream"`
	// Failed lists the events not republished, and the later events of
	// their aggregates, which are held back to keep the order.
	Failed []RepairFailure `json:"failed"`
}

// Repair republishes events (e.g. Report.Missing) from their rows, in
// (table, aggregate, version) order per aggregate, with the router's
// subject and headers and Nats-Msg-Id = event id. Rows that cannot be
// routed are reported in Failed; nothing is dead-lettered. The error is for
// failures that stop the whole repair (database, configuration).
func Repair(ctx context.Context, db DB, js jetstream.JetStream, cfg RepairConfig, events []Event, opts ...Option) (*RepairReport, error) {
	o := newOptions(opts)
	if cfg.Stream == "" {
		return nil, fmt.Errorf("%w: no event stream", ErrInvalidConfig)
	}
	if cfg.Workers <= 0 {
		cfg.Workers = DefaultRepairWorkers
	}
	tables, err := LoadTables(ctx, db, cfg.Router)
	if err != nil {
		return nil, err
	}
	byName := map[string]*Table{}
	for _, t := range tables {
		byName[t.Qualified] = t
	}
	var ropts []router.Option
	if nc := js.Conn(); nc != nil && nc.MaxPayload() > 0 {
		ropts = append(ropts, router.WithMaxPayload(int(nc.MaxPayload())))
	}
	rt, err := router.New(cfg.Router, ropts...)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	if _, err := provision.CheckStream(ctx, js, cfg.Stream); err != nil {
		return nil, err
	}
	layout, err := streamLayout(ctx, js, cfg.Stream)
	if err != nil {
		return nil, err
	}
	evs := append([]Event(nil), events...)
	SortEvents(evs)
	rp := &repairer{db: db, js: js, cfg: cfg, rt: rt, layout: layout, log: o.log, rep: &RepairReport{}, failedKeys: map[string]string{}, dupKeys: map[string]bool{},
		repairedAt: o.now().UTC().Format(time.RFC3339Nano)}
	for start := 0; start < len(evs); {
		// A chunk holds one table's events.
		end := start + 1
		for end < len(evs) && end-start < repairChunk && evs[end].Table == evs[start].Table {
			end++
		}
		t := byName[evs[start].Table]
		if t == nil {
			for _, ev := range evs[start:end] {
				rp.fail(ev, "", "the table is not in the configuration")
			}
		} else if err := rp.chunk(ctx, t, evs[start:end]); err != nil {
			return rp.rep, err
		}
		start = end
	}
	return rp.rep, nil
}

type repairer struct {
	db         DB
	js         jetstream.JetStream
	cfg        RepairConfig
	rt         *router.Router
	layout     contract.Layout
	log        *zap.Logger
	repairedAt string

	mu         sync.Mutex
	rep        *RepairReport
	failedKeys map[string]string // aggregate key -> event id that failed
	dupKeys    map[string]bool   // aggregates with an event acknowledged as a duplicate
}

func (rp *repairer) fail(ev Event, aggKey, reason string) {
	rp.mu.Lock()
	defer rp.mu.Unlock()
	rp.rep.Failed = append(rp.rep.Failed, RepairFailure{Event: ev, Reason: reason})
	if aggKey != "" {
		if _, ok := rp.failedKeys[aggKey]; !ok {
			rp.failedKeys[aggKey] = ev.EventID
		}
	}
}

type routed struct {
	ev  Event
	msg *router.Message
	hdr nats.Header // msg's headers as republished
}

// chunk reads the rows of evs (all of table t), routes them in order and
// publishes those the stream does not hold yet, one aggregate per worker
// at a time.
func (rp *repairer) chunk(ctx context.Context, t *Table, evs []Event) error {
	rs, err := routeRows(ctx, rp.db, t, rp.rt, evs, func(ev Event, reason string) {
		if reason == "" {
			rp.mu.Lock()
			rp.rep.Gone++
			rp.mu.Unlock()
			return
		}
		rp.fail(ev, aggKey(ev), reason)
	})
	if err != nil {
		return err
	}
	// The scan that reported these events missing read the stream by
	// storage time from the window's start; an event stored earlier (its
	// row dated ahead of its commit) is not missing. Look each subject up
	// once more before storing a second copy.
	stored, err := inStream(ctx, rp.js, rp.cfg.Stream, rp.layout, t.Qualified, rs)
	if err != nil {
		return err
	}
	queues := make([][]routed, rp.cfg.Workers)
	for _, r := range rs {
		if stored[r.ev.EventID] {
			rp.mu.Lock()
			rp.rep.AlreadyInStream++
			rp.mu.Unlock()
			continue
		}
		r.hdr = r.msg.Header.NATS()
		r.hdr.Del(contract.CommitLSN)
		r.hdr.Del(contract.CommitTime)
		r.hdr.Set(RepairedAtHeader, rp.repairedAt)
		h := fnv.New32a()
		_, _ = h.Write([]byte(aggKey(r.ev)))
		w := int(h.Sum32() % uint32(rp.cfg.Workers))
		queues[w] = append(queues[w], r)
	}
	g, gctx := errgroup.WithContext(ctx)
	for _, q := range queues {
		if len(q) == 0 {
			continue
		}
		g.Go(func() error {
			for _, r := range q {
				if err := rp.publish(gctx, r); err != nil {
					return err
				}
			}
			return nil
		})
	}
	return g.Wait()
}

// routeRows reads the rows of evs (all of table t) and routes them, in the
// order of evs, as the relay would. An event whose row is gone is passed to
// skip with an empty reason, one that cannot be routed with the reason.
// The router is not safe for concurrent use: call it from one goroutine.
func routeRows(ctx context.Context, db DB, t *Table, rt *router.Router, evs []Event, skip func(ev Event, reason string)) ([]routed, error) {
	cols := make([]string, len(t.Relation.Columns))
	for i, c := range t.Relation.Columns {
		cols[i] = quoteIdent(c.Name) + "::text"
	}
	ids := make([]string, 0, len(evs))
	for _, ev := range evs {
		if t.ValidID(ev.EventID) {
			ids = append(ids, ev.EventID)
		}
	}
	q := fmt.Sprintf("SELECT %s FROM %s WHERE %s", strings.Join(cols, ", "), t.Ident, t.IDIn("$1"))
	rs, err := db.Query(ctx, q, ids)
	if err != nil {
		return nil, fmt.Errorf("read rows of %s: %w", t.Qualified, err)
	}
	idIdx := t.Relation.ColumnIndex(t.Config.Columns.EventID)
	byID := make(map[string][]replication.Value, len(ids))
	for rs.Next() {
		texts := make([]*string, len(cols))
		dst := make([]any, len(cols))
		for i := range texts {
			dst[i] = &texts[i]
		}
		if err := rs.Scan(dst...); err != nil {
			rs.Close()
			return nil, fmt.Errorf("read rows of %s: %w", t.Qualified, err)
		}
		vals := make([]replication.Value, len(cols))
		for i, s := range texts {
			if s == nil {
				vals[i] = replication.Value{Kind: replication.ValueNull}
			} else {
				vals[i] = replication.Value{Kind: replication.ValueText, Data: []byte(*s)}
			}
		}
		if texts[idIdx] != nil {
			byID[*texts[idIdx]] = vals
		}
	}
	if err := rs.Err(); err != nil {
		return nil, fmt.Errorf("read rows of %s: %w", t.Qualified, err)
	}
	out := make([]routed, 0, len(evs))
	for _, ev := range evs {
		vals, ok := byID[ev.EventID]
		if !ok {
			skip(ev, "")
			continue
		}
		m, err := rt.Route(&replication.Insert{Relation: t.Relation, Values: vals}, router.CommitInfo{})
		if err != nil {
			skip(ev, "cannot route the row: "+err.Error())
			continue
		}
		out = append(out, routed{ev: ev, msg: m})
	}
	return out, nil
}

// subjectLookup is how many subjects one lookup consumer filters on.
const subjectLookup = 256

// inStream returns the event ids of rs (rows of table) that the stream
// holds, by reading the headers of every message on their subjects as the
// stream's layout stores them (the stream's subject index makes this
// cheap for per-aggregate subjects, whatever the age of the messages). An
// event is its row's only when it names the row's table (Outbox-Table).
func inStream(ctx context.Context, js jetstream.JetStream, stream string, layout contract.Layout, table string, rs []routed) (map[string]bool, error) {
	want := make(map[string]bool, len(rs))
	var subjects []string
	seen := map[string]bool{}
	for _, r := range rs {
		want[r.ev.EventID] = true
		if !seen[r.msg.Subject] {
			seen[r.msg.Subject] = true
			subjects = append(subjects, r.msg.Subject)
		}
	}
	found := map[string]bool{}
	for len(subjects) > 0 {
		n := min(len(subjects), subjectLookup)
		var filters []string
		for _, s := range subjects[:n] {
			filters = append(filters, layout.StoredFilters(s)...)
		}
		_, err := ScanStream(ctx, js, stream, filters, ScanFrom{}, func(ev *StreamEvent) error {
			if ev.Table == table && want[ev.EventID] {
				found[ev.EventID] = true
			}
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("look up the events' subjects: %w", err)
		}
		subjects = subjects[n:]
	}
	return found, nil
}

// streamLayout reads how stream stores events.
func streamLayout(ctx context.Context, js jetstream.JetStream, stream string) (contract.Layout, error) {
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return contract.Layout{}, fmt.Errorf("stream %s: %w", stream, err)
	}
	return provision.StreamLayout(s.CachedInfo().Config), nil
}

// publish sends one event unless an earlier event of its aggregate failed
// or was acknowledged as a duplicate. Such an event was missing from the
// stream when reconcile read it, and the stream dropped it for its id
// still in the duplicate window (deleted within it, say): stored now, the
// later one would go ahead of it once the rerun stores it (on a loaded
// machine the window's end fell between an aggregate's events: versions
// 3, 4, 5 stored at sequences 407, 409, 401). It returns an error only
// when ctx ends.
func (rp *repairer) publish(ctx context.Context, r routed) error {
	key := aggKey(r.ev)
	rp.mu.Lock()
	blocker, blocked := rp.failedKeys[key]
	held := rp.dupKeys[key]
	if held && !blocked {
		rp.rep.HeldBehindDuplicates++
	}
	rp.mu.Unlock()
	switch {
	case blocked:
		rp.fail(r.ev, key, "held back: the earlier event "+blocker+" of the aggregate was not republished")
		return nil
	case held:
		return nil
	}
	msg := &nats.Msg{Subject: r.msg.Subject, Header: r.hdr, Data: r.msg.Data}
	var lastErr error
	for attempt := 1; attempt <= publishAttempts; attempt++ {
		ack, err := rp.js.PublishMsg(ctx, msg, jetstream.WithExpectStream(rp.cfg.Stream))
		if err == nil {
			rp.mu.Lock()
			if ack.Duplicate {
				rp.rep.Duplicates++
				rp.dupKeys[key] = true
			} else {
				rp.rep.Published++
			}
			rp.mu.Unlock()
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		lastErr = err
		var api *jetstream.APIError
		if errors.As(err, &api) && api.Code >= 400 && api.Code < 500 && api.Code != 408 && api.Code != 429 && api.Code != 503 {
			break // a rejection: retrying the same message cannot help
		}
		rp.log.Debug("repair publish failed; retrying", zap.String("event_id", r.ev.EventID), zap.Int("attempt", attempt), zap.Error(err))
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Duration(attempt) * 200 * time.Millisecond):
		}
	}
	rp.fail(r.ev, aggKey(r.ev), "publish: "+lastErr.Error())
	return nil
}

// aggKey identifies an event's aggregate, as the router's ordering key does.
func aggKey(ev Event) string { return ev.Table + "\x00" + ev.AggregateType + "\x00" + ev.AggregateID }

func quoteIdent(s string) string { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }
