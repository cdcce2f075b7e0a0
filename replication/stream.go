package replication

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/replication/internal/pgoutput"
)

// Watermark tells the stream which position it may confirm to PostgreSQL.
// The ack tracker (watermark.Tracker) implements it; the stream never confirms a
// position on its own.
type Watermark interface {
	// Confirmed returns the end LSN of the newest transaction that, with
	// every earlier one, is fully acknowledged or dead-lettered.
	Confirmed() LSN
	// Idle reports that no transaction is open or waiting for acks: every
	// change handed out by Next so far is settled.
	Idle() bool
}

// Option configures a Stream; Open fails with an error wrapping
// ErrInvalidOption when one is invalid.
type Option func(*options) error

type options struct {
	log      *zap.Logger
	limit    func() LSN
	relation func(ctx context.Context, rel *Relation) error
}

// WithConfirmLimit caps what the stream confirms at limit(), read at every
// status update (default: no cap). The relay passes the position up to
// which the publication was last verified, so that a table dropped from
// it is never confirmed past: the watermark alone sees nothing of the
// rows the publication withheld, and an idle session would confirm the
// server's WAL end over them.
func WithConfirmLimit(limit func() LSN) Option {
	return func(o *options) error {
		if limit == nil {
			return fmt.Errorf("%w: nil confirm limit", ErrInvalidOption)
		}
		o.limit = limit
		return nil
	}
}

// WithRelationHook has Next call f, before it returns any change of the
// relation, whenever the server (re)describes a relation: at its first
// change in the session and after anything invalidated its description
// (ALTER TABLE, and ALTER PUBLICATION … ADD TABLE). An error from f ends
// the session: Next returns it. Default: none.
func WithRelationHook(f func(ctx context.Context, rel *Relation) error) Option {
	return func(o *options) error {
		if f == nil {
			return fmt.Errorf("%w: nil relation hook", ErrInvalidOption)
		}
		o.relation = f
		return nil
	}
}

// WithLogger sets the logger (default: no logging); it must not be nil.
func WithLogger(l *zap.Logger) Option {
	return func(o *options) error {
		if l == nil {
			return fmt.Errorf("%w: nil logger", ErrInvalidOption)
		}
		o.log = l
		return nil
	}
}

// Stream reads decoded changes from a replication slot. One goroutine owns
// it: Next, Pending, SendStatus and Close must not be called concurrently.
type Stream struct {
	cfg      Config
	wm       Watermark
	log      *zap.Logger
	conn     *pgconn.PgConn
	limit    func() LSN                                     // nil: no cap
	relation func(ctx context.Context, rel *Relation) error // nil: none

	received   LSN // newest WAL position received
	serverEnd  LSN // server's sent position from the last keepalive
	startEnd   LSN // end of the server's WAL when streaming started (Behind)
	sentFlush  LSN // flush position of the last status update
	nextStatus time.Time
	lastRecv   time.Time // when the server was last heard from

	// The connection's read deadline and the context whose cancellation
	// interrupts a read: set once per status interval and once per context,
	// not per message (see receive).
	readDeadline time.Time
	watched      context.Context
	stopWatch    func() bool
	// wake is when Next returns a Wake if nothing arrived (zero: never).
	wake time.Time

	relations map[uint32]*Relation

	// Reused decode targets: the values Next returns are valid until the
	// next call.
	rawInsert pgoutput.Insert
	rawBegin  pgoutput.Begin
	rawCommit pgoutput.Commit
	rawMsg    pgoutput.Message
	rawTrunc  pgoutput.Truncate
	begin     Begin
	commit    Commit
	insert    Insert
	message   Message
	truncate  Truncate
	wakeEv    Wake
	inTx      bool
	// The LSN of the transaction's last change and how many changes before
	// it shared that LSN: Insert.Ordinal.
	lastChange LSN
	sameLSN    uint32
}

// Open connects with replication=database, checks the slot and starts
// streaming from the slot's confirmed position. Options: WithLogger,
// WithConfirmLimit, WithRelationHook. It fails with ErrSlotInUse
// while another process streams from the slot, and with ErrSlotLost when the
// slot's WAL was removed.
func Open(ctx context.Context, cfg Config, wm Watermark, opts ...Option) (*Stream, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	o := options{log: zap.NewNop()}
	for _, opt := range opts {
		if err := opt(&o); err != nil {
			return nil, err
		}
	}
	s := &Stream{cfg: cfg, wm: wm, log: o.log, limit: o.limit, relation: o.relation, relations: map[uint32]*Relation{}}
	// Check over a plain connection first: it gives precise errors (lost,
	// in use, missing) that START_REPLICATION reports only vaguely.
	sql, err := connectSQL(ctx, cfg.URL)
	if err != nil {
		return nil, connectFailure(err)
	}
	st, err := openChecks(ctx, sql, cfg)
	if err == nil {
		s.startEnd = walEnd(ctx, sql)
	}
	sql.Close(ctx)
	if err != nil {
		return nil, err
	}
	switch {
	case !st.Exists:
		return nil, actionable(ErrSlotMissing, "run `outbox-relay setup`", "slot %q", cfg.Slot)
	case st.WALStatus == "lost":
		return nil, slotLostError(cfg.Slot)
	case st.Active:
		return nil, actionable(ErrSlotInUse, "another relay instance is streaming; this one waits and retries", "slot %q is active for pid %d", cfg.Slot, st.ActivePID)
	}
	pcfg, err := pgconn.ParseConfig(cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("parse postgres URL: %w", redactErr(err))
	}
	pcfg.RuntimeParams["replication"] = "database"
	pcfg.RuntimeParams["application_name"] = cfg.ApplicationName
	// The router parses timestamps in pgoutput's text output: fix its form.
	pcfg.RuntimeParams["DateStyle"] = "ISO"
	pcfg.RuntimeParams["TimeZone"] = "UTC"
	conn, err := pgconn.ConnectConfig(ctx, pcfg)
	if err != nil {
		return nil, connectFailure(fmt.Errorf("connect for replication to %s: %w", describe(*pcfg), err))
	}
	s.conn = conn
	args := []string{"proto_version '1'", "publication_names '" + cfg.Publication + "'"}
	if cfg.Messages {
		args = append(args, "messages 'true'")
	}
	// Start at 0/0: the server resumes from the slot's confirmed_flush_lsn,
	// which is the only position the relay ever vouched for.
	err = pglogrepl.StartReplication(ctx, conn, cfg.Slot, 0, pglogrepl.StartReplicationOptions{Mode: pglogrepl.LogicalReplication, PluginArgs: args})
	if err != nil {
		conn.Close(context.Background())
		return nil, classifyStartError(cfg.Slot, err)
	}
	s.sentFlush = st.ConfirmedFlushLSN
	s.received = st.ConfirmedFlushLSN
	s.nextStatus = time.Now().Add(cfg.StatusInterval)
	s.lastRecv = time.Now()
	s.log.Info("replication started", zap.String("slot", cfg.Slot), zap.String("publication", cfg.Publication), zap.Stringer("lsn", st.ConfirmedFlushLSN))
	return s, nil
}

func classifyStartError(slot string, err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case pgerrcode.ObjectInUse:
			return actionable(ErrSlotInUse, "another relay instance is streaming; this one waits and retries", "%s", pgErr.Message)
		case pgerrcode.ObjectNotInPrerequisiteState:
			if strings.Contains(pgErr.Message, "invalidated") || strings.Contains(pgErr.Detail, "wal_status") {
				return slotLostError(slot)
			}
		case pgerrcode.UndefinedObject:
			return actionable(ErrPublicationMissing, "run `outbox-relay setup`", "%s", pgErr.Message)
		}
	}
	return fmt.Errorf("start replication from slot %q: %w", slot, err)
}

// BackendPID returns the process id of the server's walsender for this
// stream.
func (s *Stream) BackendPID() uint32 { return s.conn.PID() }

// Next returns the next change: *Begin, *Insert, *Message, *Commit or
// *Truncate, or *Wake (see WakeAt). The value is reused: it is valid until
// the next call. Next answers keepalives and sends periodic status updates
// while it waits.
//
// Reuse is kept deliberately, and stays between the stream and the one
// goroutine that owns it: the relay's pipeline routes each change before it
// asks for the next, and the router copies whatever it keeps. Values the
// caller owns would cost a copy of every row and allocations per change
// (bench/README.md, issue 12).
func (s *Stream) Next(ctx context.Context) (any, error) {
	for {
		if err := s.maybeSendStatus(ctx); err != nil {
			return nil, err
		}
		raw, err := s.receive(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil, fmt.Errorf("receive replication message: %w", ctx.Err())
			}
			if pgconn.Timeout(err) {
				if silent := time.Since(s.lastRecv); silent > s.cfg.ReceiveTimeout {
					// A stalled network or a hung server: no FIN ever comes,
					// so only silence tells. Reconnecting is safe: nothing
					// is confirmed that was not acked.
					return nil, fmt.Errorf("%w: nothing received from PostgreSQL for %s", ErrServerSilent, silent.Round(time.Millisecond))
				}
				if !s.wake.IsZero() && !time.Now().Before(s.wake) {
					s.wake = time.Time{}
					return &s.wakeEv, nil
				}
				continue // time for a status update
			}
			return nil, fmt.Errorf("receive replication message: %w", err)
		}
		s.lastRecv = time.Now()
		switch msg := raw.(type) {
		case *pgproto3.CopyData:
			if len(msg.Data) == 0 {
				return nil, fmt.Errorf("%w: empty CopyData", ErrProtocol)
			}
			switch msg.Data[0] {
			case pglogrepl.PrimaryKeepaliveMessageByteID:
				ka, err := pglogrepl.ParsePrimaryKeepaliveMessage(msg.Data[1:])
				if err != nil {
					return nil, fmt.Errorf("%w: keepalive: %v", ErrProtocol, err)
				}
				if ka.ServerWALEnd > s.serverEnd {
					s.serverEnd = ka.ServerWALEnd
				}
				if ka.ReplyRequested {
					// The server is about to time us out: answer now.
					if err := s.SendStatus(ctx); err != nil {
						return nil, err
					}
				}
			case pglogrepl.XLogDataByteID:
				ev, err := s.decodeXLogData(ctx, msg.Data[1:])
				if err != nil {
					return nil, err
				}
				if ev != nil {
					return ev, nil
				}
			}
		case *pgproto3.CopyDone:
			return nil, fmt.Errorf("replication stream ended by the server")
		case *pgproto3.ErrorResponse:
			return nil, fmt.Errorf("replication stream: %w", pgconn.ErrorResponseToPgError(msg))
		}
	}
}

// receive reads the next protocol message, waiting at most until the next
// status update is due or ctx ends.
//
// A context with a deadline per call (what pgconn's ReceiveMessage(ctx)
// offers) costs a timer, a context and an AfterFunc registration per
// message (measured in bench/README.md). The
// same mechanism, the connection's read deadline, is set here only when the
// status time moves, and ctx is watched once per context: pgconn reads
// without watching anything when given context.Background(), and a read
// that times out (deadline or cancellation) leaves the connection usable,
// exactly as with a deadline context.
func (s *Stream) receive(ctx context.Context) (pgproto3.BackendMessage, error) {
	nc := s.conn.Conn()
	if ctx != s.watched {
		if s.stopWatch != nil {
			s.stopWatch()
		}
		// A previous context's cancellation may have moved the deadline.
		s.watched, s.readDeadline = ctx, time.Time{}
		s.stopWatch = context.AfterFunc(ctx, func() {
			// A deadline in the past wakes a blocked read at once.
			_ = nc.SetReadDeadline(time.Unix(1, 0))
		})
	}
	deadline := s.nextStatus
	if !s.wake.IsZero() && s.wake.Before(deadline) && (time.Now().Before(s.wake) || !s.Pending()) {
		// A wake time already past is not a wait: with the deadline
		// there the read would fail at once, without looking at what
		// the server has already sent (Go's poller refuses a read past
		// its deadline), and a Wake would come while changes are still
		// waiting. So it takes effect only once nothing is (see Pending).
		deadline = s.wake
	}
	if !s.readDeadline.Equal(deadline) {
		if err := nc.SetReadDeadline(deadline); err != nil {
			return nil, err
		}
		s.readDeadline = deadline
	}
	return s.conn.ReceiveMessage(context.Background())
}

// WakeAt makes Next return a *Wake once t has passed while it waits for
// the server (once: a Wake clears it; the zero time cancels it). It moves
// the connection's read deadline, as a status update does, so a caller
// that sets it once per batch of changes costs a clock reading per change
// while it is set; while changes keep arriving no Wake comes, and none
// comes while changes are waiting to be read (Pending), however long ago
// t passed.
func (s *Stream) WakeAt(t time.Time) { s.wake = t }

// Pending reports whether more from the server is already waiting to be
// decoded: received into the connection's read buffer, or readable from
// its socket without blocking. It is what tells a backlog, read as fast
// as this process is scheduled, from a stream that has caught up with the
// server: the time between two changes says nothing about it on a loaded
// machine. False is the safe answer: what sits where it cannot look (a TLS
// record decrypted in part) reads as not waiting.
func (s *Stream) Pending() bool {
	if s.conn == nil || s.conn.IsClosed() {
		return false
	}
	return s.conn.Frontend().ReadBufferLen() > 0 || readable(s.conn.Conn())
}

// Behind reports whether the stream has not yet reached the end the
// server's WAL had when streaming started: it is reading a backlog. That
// holds also while the server sends the backlog slower than this process
// reads it (a walsender short of CPU on a loaded machine), when Pending
// finds nothing waiting between two of its messages. It turns false at
// the first change or keepalive at or past that end; the server sends a
// keepalive when it has sent all its WAL.
func (s *Stream) Behind() bool { return max(s.received, s.serverEnd) < s.startEnd }

// xlogHeader is WALStart, ServerWALEnd and ServerTime, 8 bytes each.
const xlogHeader = 24

func (s *Stream) decodeXLogData(ctx context.Context, b []byte) (any, error) {
	if len(b) < xlogHeader+1 {
		return nil, fmt.Errorf("%w: XLogData of %d bytes", ErrProtocol, len(b))
	}
	walStart := LSN(be64(b))
	if walStart > s.received {
		s.received = walStart
	}
	data := b[xlogHeader:]
	typ, body := data[0], data[1:]
	switch typ {
	case pgoutput.TypeBegin:
		if err := pgoutput.DecodeBegin(body, &s.rawBegin); err != nil {
			return nil, fmt.Errorf("%w: %v", ErrProtocol, err)
		}
		s.begin = Begin{XID: s.rawBegin.XID, FinalLSN: LSN(s.rawBegin.FinalLSN), CommitTime: s.rawBegin.CommitTime}
		s.inTx = true
		s.lastChange, s.sameLSN = 0, 0
		return &s.begin, nil
	case pgoutput.TypeCommit:
		if err := pgoutput.DecodeCommit(body, &s.rawCommit); err != nil {
			return nil, fmt.Errorf("%w: %v", ErrProtocol, err)
		}
		s.commit = Commit{CommitLSN: LSN(s.rawCommit.CommitLSN), EndLSN: LSN(s.rawCommit.EndLSN), CommitTime: s.rawCommit.CommitTime}
		s.inTx = false
		return &s.commit, nil
	case pgoutput.TypeRelation:
		return nil, s.decodeRelation(ctx, body)
	case pgoutput.TypeInsert:
		if err := pgoutput.DecodeInsert(body, &s.rawInsert); err != nil {
			return nil, fmt.Errorf("%w: %v", ErrProtocol, err)
		}
		rel, ok := s.relations[s.rawInsert.RelationID]
		if !ok {
			return nil, fmt.Errorf("%w: insert into relation %d before its Relation message", ErrProtocol, s.rawInsert.RelationID)
		}
		vals := s.insert.Values[:0]
		for _, c := range s.rawInsert.Columns {
			vals = append(vals, Value{Kind: valueKind(c.Kind), Data: c.Data})
		}
		s.insert = Insert{Relation: rel, Values: vals, LSN: walStart, Ordinal: s.ordinal(walStart), Tx: &s.begin}
		return &s.insert, nil
	case pgoutput.TypeMessage:
		if err := pgoutput.DecodeMessage(body, &s.rawMsg); err != nil {
			return nil, fmt.Errorf("%w: %v", ErrProtocol, err)
		}
		s.message = Message{Transactional: s.rawMsg.Transactional, Prefix: s.rawMsg.Prefix, Content: s.rawMsg.Content, LSN: LSN(s.rawMsg.LSN)}
		if s.message.Transactional && s.inTx {
			s.message.Tx = &s.begin
		}
		return &s.message, nil
	case pgoutput.TypeTruncate:
		if err := pgoutput.DecodeTruncate(body, &s.rawTrunc); err != nil {
			return nil, fmt.Errorf("%w: %v", ErrProtocol, err)
		}
		s.truncate.Relations = s.truncate.Relations[:0]
		for _, id := range s.rawTrunc.RelationIDs {
			if rel, ok := s.relations[id]; ok {
				s.truncate.Relations = append(s.truncate.Relations, rel)
			}
		}
		return &s.truncate, nil
	case pgoutput.TypeType, pgoutput.TypeOrigin, pgoutput.TypeUpdate, pgoutput.TypeDelete:
		// Types matter only for binary mode; origins only for multi-master
		// setups. UPDATE and DELETE are outside the outbox contract (the
		// publication publishes inserts only) and never become events.
		return nil, nil
	default:
		return nil, fmt.Errorf("%w: unknown pgoutput message type %q", ErrProtocol, typ)
	}
}

// decodeRelation records a Relation message and tells the relation hook.
func (s *Stream) decodeRelation(ctx context.Context, body []byte) error {
	var r pgoutput.Relation
	if err := pgoutput.DecodeRelation(body, &r); err != nil {
		return fmt.Errorf("%w: %v", ErrProtocol, err)
	}
	rel := &Relation{ID: r.ID, Namespace: r.Namespace, Name: r.Name, Columns: make([]Column, len(r.Columns))}
	for i, c := range r.Columns {
		rel.Columns[i] = Column{Name: c.Name, TypeOID: c.TypeOID}
	}
	// A new pointer on every Relation message: plans cached by the
	// router for the old shape are not reused after ALTER TABLE.
	s.relations[r.ID] = rel
	s.log.Debug("relation", zap.String("table", rel.QualifiedName()), zap.Int("columns", len(rel.Columns)))
	if s.relation != nil {
		return s.relation(ctx, rel)
	}
	return nil
}

// ordinal returns the position of a change at lsn among the transaction's
// changes sharing that LSN.
func (s *Stream) ordinal(lsn LSN) uint32 {
	if lsn == s.lastChange {
		s.sameLSN++
	} else {
		s.lastChange, s.sameLSN = lsn, 0
	}
	return s.sameLSN
}

func valueKind(k byte) ValueKind {
	switch k {
	case pgoutput.KindText:
		return ValueText
	case pgoutput.KindBinary:
		return ValueBinary
	case pgoutput.KindUnchanged:
		return ValueUnchanged
	default:
		return ValueNull
	}
}

func be64(b []byte) uint64 {
	return uint64(b[0])<<56 | uint64(b[1])<<48 | uint64(b[2])<<40 | uint64(b[3])<<32 |
		uint64(b[4])<<24 | uint64(b[5])<<16 | uint64(b[6])<<8 | uint64(b[7])
}

// progressInterval rate-limits the status updates sent because the
// watermark moved, between the periodic ones.
const progressInterval = 100 * time.Millisecond

func (s *Stream) maybeSendStatus(ctx context.Context) error {
	now := time.Now()
	if now.After(s.nextStatus) {
		return s.SendStatus(ctx)
	}
	// The time test first: flushPosition takes the watermark's lock, and
	// this runs before every message received.
	if now.After(s.nextStatus.Add(progressInterval-s.cfg.StatusInterval)) && s.flushPosition() > s.sentFlush {
		return s.SendStatus(ctx)
	}
	return nil
}

// flushPosition is what may be confirmed now: the watermark, or the server's
// WAL end when nothing is in flight, so an idle outbox does not pin WAL that
// other tables' writes produce; never past the confirm limit.
func (s *Stream) flushPosition() LSN {
	flush := s.wm.Confirmed()
	if !s.inTx && s.wm.Idle() && s.serverEnd > flush {
		flush = s.serverEnd
	}
	if s.limit != nil {
		flush = min(flush, s.limit())
	}
	if flush < s.sentFlush {
		flush = s.sentFlush
	}
	return flush
}

// Heartbeat sends a status update if one is due (periodic, or because the
// watermark moved). The pipeline calls it while it waits for capacity.
func (s *Stream) Heartbeat(ctx context.Context) error { return s.maybeSendStatus(ctx) }

// Confirmed returns the flush position of the last status update sent;
// before the first one, the slot's confirmed position when streaming
// started.
func (s *Stream) Confirmed() LSN { return s.sentFlush }

// SendStatus sends a standby status update now. The pipeline calls it while
// it waits for publish capacity, so the server hears from the relay even
// when backpressure stops reading.
func (s *Stream) SendStatus(ctx context.Context) error {
	if s.conn.IsClosed() {
		// pgconn closes a connection whose operation was cancelled from a
		// goroutine of its own, which is still writing to it: writing too
		// would race with it, and nothing would be read anyway.
		return fmt.Errorf("send standby status: %w", net.ErrClosed)
	}
	flush := s.flushPosition()
	write := s.received
	if flush > write {
		write = flush
	}
	err := pglogrepl.SendStandbyStatusUpdate(ctx, s.conn, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: write,
		WALFlushPosition: flush,
		WALApplyPosition: flush,
		// After a third of the receive timeout in silence, ask for a
		// keepalive: an idle but healthy server then always answers.
		ReplyRequested: time.Since(s.lastRecv) > s.cfg.ReceiveTimeout/3,
	})
	if err != nil {
		return fmt.Errorf("send standby status (flush %s): %w", flush, err)
	}
	if flush != s.sentFlush {
		s.log.Debug("confirmed", zap.Stringer("lsn", flush))
	}
	s.sentFlush = flush
	s.nextStatus = time.Now().Add(s.cfg.StatusInterval)
	return nil
}

// Close sends a final status update with the latest watermark and closes
// the connection.
func (s *Stream) Close(ctx context.Context) error {
	if s.conn == nil {
		return nil
	}
	if s.stopWatch != nil {
		s.stopWatch()
		s.stopWatch, s.watched = nil, nil
	}
	var err error
	if !s.conn.IsClosed() {
		err = s.SendStatus(ctx)
	}
	cerr := s.conn.Close(ctx)
	s.conn = nil
	if err != nil {
		return err
	}
	return cerr
}
