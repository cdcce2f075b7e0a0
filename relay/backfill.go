package relay

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/router"
)

// BackfillReport says what Backfill did.
type BackfillReport struct {
	// SlotCreated is false when the slot already existed: nothing was
	// backfilled, since rows before it were handled when it was created.
	SlotCreated     bool
	ConsistentPoint replication.LSN
	Rows            int // rows published (events and dead letters)
	DeadLettered    int
	// AlreadyStreamed is the waiting rows not published because the event
	// stream already held their event (a slot created again after a
	// teardown or a lost slot).
	AlreadyStreamed int
	// Expired is the waiting rows not published because they are older
	// than the event stream's first message after its limits removed
	// older ones: reconcile reports them as expired.
	Expired int
	// Actions says what creating the slot did in PostgreSQL (the
	// publication, the slot), in order; empty when the slot existed.
	Actions []string
}

// Progress is told how many of the backfill's rows are published so far.
type Progress func(table string, done, total int)

// pendingColumn marks unpublished rows in tables that have it (the seed's
// publish_state): a polling relay being replaced set it to PUBLISHED for
// what it already sent.
const pendingColumn = "publish_state"

// Backfill creates the slot with an exported snapshot and publishes the
// outbox rows committed before it — rows with publish_state = 'PENDING' in
// tables that have that column, every row otherwise, less those whose event
// the stream already holds (streamedIDs) — in (aggregate id, version)
// order. Streaming from the slot afterwards continues exactly
// where the snapshot ends: no gap and no overlap. It is how a first install
// or a cut-over from a polling relay publishes the rows already waiting.
//
// The whole backfill holds the slot's backfill lock (a relay streaming from
// the slot waits for it), and a record in the database says whether it
// finished. When a backfill was interrupted, the next Backfill drops the
// slot (if nothing was streamed from it) and starts again from a new
// snapshot; rows published twice are de-duplicated by their Nats-Msg-Id
// within the stream's duplicate window. Until then `run` refuses the slot.
func Backfill(ctx context.Context, cfg Config, nc *nats.Conn, log *zap.Logger, progress Progress) (BackfillReport, error) {
	var rep BackfillReport
	if log == nil {
		log = zap.NewNop()
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return rep, err
	}
	// Streams first: with no stream the publishes would only be retried.
	// Their warnings are the relay's to log, once, when it starts streaming
	// (setup prints its own).
	if _, err := ensureStreams(ctx, js, cfg, log); err != nil {
		return rep, err
	}
	guard, err := replication.LockBackfill(ctx, cfg.Replication)
	if err != nil {
		return rep, err
	}
	defer guard.Close(context.Background())
	snap, err := createBackfillSlot(ctx, guard, cfg.Replication, log)
	if snap == nil || err != nil {
		return rep, err
	}
	defer snap.Close(context.Background())
	rep.SlotCreated, rep.ConsistentPoint, rep.Actions = true, snap.ConsistentPoint, snap.Actions
	log.Info("slot created with snapshot", zap.String("slot", cfg.Replication.Slot), zap.Stringer("consistent_point", snap.ConsistentPoint))

	rt, err := router.New(cfg.Router, router.WithMaxPayload(int(nc.MaxPayload())))
	if err != nil {
		return rep, err
	}
	pub, stopPub, err := startBackfillPublisher(nc, js, cfg, log)
	if err != nil {
		return rep, err
	}
	defer stopPub()
	tx, closeTx, err := snapshotTx(ctx, cfg.Replication.URL, snap.Snapshot)
	if err != nil {
		return rep, err
	}
	defer closeTx()
	// The rows are already committed; as commit information they carry the
	// slot's consistent point (committed before it) and the backfill time.
	commit := router.CommitInfo{LSN: snap.ConsistentPoint, Time: time.Now()}
	known, err := streamedIDs(ctx, js, tx, cfg)
	if err != nil {
		return rep, err
	}
	var dead int
	for _, table := range cfg.Replication.Tables {
		n, d, s, err := backfillTable(ctx, tx, table, tableConfig(cfg.Router, table), rt, pub, commit, progress, known)
		rep.Rows += n
		rep.AlreadyStreamed += s
		dead += d
		if err != nil {
			return rep, fmt.Errorf("backfill %s: %w", table, err)
		}
	}
	rep.DeadLettered = dead
	rep.Expired = known.expired
	rep.AlreadyStreamed -= known.expired
	if err := pub.Drain(ctx); err != nil {
		return rep, fmt.Errorf("backfill: wait for acks: %w", err)
	}
	return rep, guard.Finish(ctx)
}

// startBackfillPublisher runs a per-key publisher for the backfill; stop
// ends its Run, waits for it and closes it.
func startBackfillPublisher(nc *nats.Conn, js jetstream.JetStream, cfg Config, log *zap.Logger) (pub *publisher.Publisher, stop func(), err error) {
	pub, err = publisher.New(nc, cfg.Publisher, publisher.WithLogger(log.Named("publisher")), publisher.WithStreamLookup(streamLookup(js, cfg.Stream.Name)),
		publisher.WithExpectedStream(expectedStream(cfg)))
	if err != nil {
		return nil, nil, err
	}
	pctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- pub.Run(pctx) }()
	return pub, func() { cancel(); <-done; _ = pub.Close() }, nil
}

// snapshotTx opens a read-only transaction on the slot's exported
// snapshot (a snapshot of its own when snapshot is ""); closeTx rolls it
// back and closes its connection.
func snapshotTx(ctx context.Context, url, snapshot string) (tx pgx.Tx, closeTx func(), err error) {
	ccfg, err := pgx.ParseConfig(url)
	if err != nil {
		return nil, nil, fmt.Errorf("connect for backfill: %w", err)
	}
	// The rows are read as text and routed like pgoutput's text output:
	// the same DateStyle and TimeZone as the replication connection.
	ccfg.RuntimeParams["DateStyle"], ccfg.RuntimeParams["TimeZone"] = "ISO", "UTC"
	conn, err := pgx.ConnectConfig(ctx, ccfg)
	if err != nil {
		return nil, nil, fmt.Errorf("connect for backfill: %w", err)
	}
	closeConn := func() { _ = conn.Close(context.Background()) }
	tx, err = conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		closeConn()
		return nil, nil, err
	}
	closeTx = func() { _ = tx.Rollback(context.Background()); closeConn() }
	if snapshot == "" {
		return tx, closeTx, nil
	}
	if _, err := tx.Exec(ctx, "SET TRANSACTION SNAPSHOT '"+snapshot+"'"); err != nil {
		closeTx()
		return nil, nil, fmt.Errorf("import snapshot %s: %w", snapshot, err)
	}
	return tx, closeTx, nil
}

// createBackfillSlot creates the slot with its snapshot under the backfill
// lock, recording the backfill before the slot exists so that a crash at
// any later point leaves it marked unfinished. It returns nil (nothing to
// backfill) when the slot exists after a finished backfill, or was
// created without one. The slot of an interrupted backfill is dropped and
// created anew, when nothing was streamed from it.
func createBackfillSlot(ctx context.Context, guard *replication.BackfillGuard, cfg replication.Config, log *zap.Logger) (*replication.SnapshotSlot, error) {
	st, err := guard.State(ctx)
	if err != nil {
		return nil, err
	}
	slot, err := replication.Status(ctx, cfg.URL, cfg.Slot)
	if err != nil {
		return nil, err
	}
	if slot.Exists {
		if !st.Incomplete() {
			return nil, nil
		}
		if err := guard.Restart(ctx, st); err != nil {
			return nil, err
		}
		log.Warn("an earlier backfill of the slot did not finish: dropped the slot, backfilling again from a new snapshot",
			zap.String("slot", cfg.Slot), zap.Time("interrupted_backfill_started_at", st.StartedAt), zap.Stringer("old_consistent_point", st.ConsistentPoint))
	}
	if err := guard.Start(ctx); err != nil {
		return nil, err
	}
	snap, err := replication.CreateSlotWithSnapshot(ctx, cfg)
	if errors.Is(err, replication.ErrSlotExists) {
		// Created meanwhile without a backfill (setup with backfill off):
		// there is nothing of ours to finish.
		return nil, guard.Forget(ctx)
	}
	if err != nil {
		// No slot: a record of its backfill would be debris that makes
		// the next setup, and status, report an interrupted backfill.
		if ferr := guard.Forget(ctx); ferr != nil {
			return nil, fmt.Errorf("%w (and %v)", err, ferr)
		}
		return nil, err
	}
	if err := guard.Created(ctx, snap.ConsistentPoint); err != nil {
		snap.Close(context.Background())
		return nil, err
	}
	return snap, nil
}

func tableConfig(c router.Config, table string) router.TableConfig {
	for _, t := range c.Tables {
		if router.QualifiedTable(t.Table) == table {
			return t
		}
	}
	return router.TableConfig{Table: table}
}

func backfillTable(ctx context.Context, tx pgx.Tx, table string, tc router.TableConfig, rt *router.Router, pub *publisher.Publisher, commit router.CommitInfo, progress Progress, known streamed) (published, dead, skipped int, err error) {
	rel, ident, err := tableRelation(ctx, tx, table)
	if err != nil {
		return 0, 0, 0, err
	}
	where := ""
	if rel.ColumnIndex(pendingColumn) >= 0 {
		where = " WHERE " + pgx.Identifier{"src", pendingColumn}.Sanitize() + " = 'PENDING'"
	}
	var total int
	if err := tx.QueryRow(ctx, "SELECT count(*) FROM "+ident+" AS src"+where).Scan(&total); err != nil {
		return 0, 0, 0, err
	}
	rows, err := tx.Query(ctx, backfillSelect(rel, tc, ident, where))
	if err != nil {
		return 0, 0, 0, err
	}
	defer rows.Close()
	vals := make([]replication.Value, len(rel.Columns))
	idIdx := rel.ColumnIndex(or(tc.Columns.EventID, router.DefaultEventIDColumn))
	lastReport := time.Now()
	read, reported := 0, -1
	ids := rowIDs{}
	for rows.Next() {
		raw := rows.RawValues()
		read++
		if idIdx >= 0 && raw[idIdx] != nil && known.has(table, raw[idIdx]) {
			skipped++
			continue
		}
		for i := range vals {
			if raw[i] == nil {
				vals[i] = replication.Value{Kind: replication.ValueNull}
			} else {
				vals[i] = replication.Value{Kind: replication.ValueText, Data: raw[i]}
			}
		}
		ins := &replication.Insert{Relation: rel, Values: vals}
		m, unroutable := backfillMessage(rt, ins, commit, func() { ins.LSN, ins.Ordinal = ids.of(raw) })
		if unroutable {
			dead++
		}
		if err := pub.Publish(ctx, m); err != nil {
			return published, dead, skipped, err
		}
		published++
		if progress != nil && (time.Since(lastReport) > 200*time.Millisecond || read == total) {
			progress(table, read, total)
			lastReport, reported = time.Now(), read
		}
	}
	if progress != nil && reported != read {
		progress(table, read, total)
	}
	return published, dead, skipped, rows.Err()
}

// tableRelation reads table's columns from the catalog, as a relation the
// router maps like pgoutput's, and returns its quoted name.
func tableRelation(ctx context.Context, tx pgx.Tx, table string) (*replication.Relation, string, error) {
	schema, name, _ := strings.Cut(table, ".")
	ident := pgx.Identifier{schema, name}.Sanitize()
	rel := &replication.Relation{Namespace: schema, Name: name}
	rows, err := tx.Query(ctx, `SELECT a.attname, a.atttypid, c.oid FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
WHERE a.attrelid = $1::regclass AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum`, ident)
	if err != nil {
		return nil, "", err
	}
	defer rows.Close()
	for rows.Next() {
		var col replication.Column
		if err := rows.Scan(&col.Name, &col.TypeOID, &rel.ID); err != nil {
			return nil, "", err
		}
		rel.Columns = append(rel.Columns, col)
	}
	return rel, ident, rows.Err()
}

// backfillSelect returns the query reading the rows a backfill publishes,
// every column as text.
func backfillSelect(rel *replication.Relation, tc router.TableConfig, ident, where string) string {
	sel := make([]string, len(rel.Columns))
	for i, c := range rel.Columns {
		sel[i] = pgx.Identifier{c.Name}.Sanitize() + "::text"
	}
	q := "SELECT " + strings.Join(sel, ", ") + " FROM " + ident + " AS src" + where
	// Aggregate order, so each aggregate's events reach the stream by
	// version; a table without those columns is read as it is and every
	// row is dead-lettered by the router with the reason.
	aggCol, verCol := or(tc.Columns.AggregateID, router.DefaultAggregateIDColumn), or(tc.Columns.AggregateVersion, router.DefaultAggregateVersionColumn)
	if rel.ColumnIndex(aggCol) >= 0 && rel.ColumnIndex(verCol) >= 0 {
		// Qualified: a bare name would sort by the ::text output column.
		q += " ORDER BY " + pgx.Identifier{"src", aggCol}.Sanitize() + ", " + pgx.Identifier{"src", verCol}.Sanitize()
	}
	return q
}

// backfillMessage routes a backfilled row, or builds its dead-letter
// record (unroutable reports that); position sets the row's stand-in
// position first (rowIDs).
func backfillMessage(rt *router.Router, ins *replication.Insert, commit router.CommitInfo, position func()) (m *publisher.Message, unroutable bool) {
	rm, err := rt.Route(ins, commit)
	if err != nil {
		position()
		dl := rt.DeadLetter(ins, commit, err)
		return &publisher.Message{Subject: dl.Subject, Header: dl.Header, Data: dl.Data}, true
	}
	return routedMessage(rt, rm), false
}

// routedMessage is rm to publish per aggregate, dead-lettered with the
// publisher's reason when the stream refuses it.
func routedMessage(rt *router.Router, rm *router.Message) *publisher.Message {
	return &publisher.Message{Subject: rm.Subject, Header: rm.Header, Data: rm.Data, Key: rm.Key,
		Owner: publisher.DeadLetterFuncs{Record: func(reason error) *publisher.Message {
			dl := rt.DeadLetterMessage(rm, reason)
			return &publisher.Message{Subject: dl.Subject, Header: dl.Header, Data: dl.Data}
		}}}
}

func or(v, def string) string {
	if v != "" {
		return v
	}
	return def
}

// rowIDs gives backfilled rows the position their dead-letter record's id
// is made of when the row has no usable event id (router.DeadLetter). A
// backfilled row has no WAL position of its own, and its number in the
// read order is no id: a re-run reads a new snapshot, where a row inserted
// in between shifts every later position, so one row's record was taken
// for a duplicate of another's and lost. A hash of the row's values stands
// in for the LSN, and the number of identical rows met before it for the
// ordinal: identical rows are interchangeable, so the k-th keeps its id.
// Memory: one entry per distinct unroutable row.
type rowIDs map[uint64]uint32

func (ids rowIDs) of(raw [][]byte) (replication.LSN, uint32) {
	h := fnv.New64a()
	var n [binary.MaxVarintLen64 + 1]byte
	for _, v := range raw {
		if v == nil {
			h.Write([]byte{0})
			continue
		}
		n[0] = 1
		k := binary.PutUvarint(n[1:], uint64(len(v)))
		h.Write(n[:1+k])
		h.Write(v)
	}
	sum := h.Sum64()
	ord := ids[sum]
	ids[sum] = ord + 1
	return replication.LSN(sum), ord
}
