package dlq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/contract"
)

// Defaults of the relay's dead-letter stream and of the audit stream of
// actions on it.
const (
	DefaultRelayStream  = "OUTBOX_DLQ"
	DefaultAuditStream  = "OUTBOX_DLQ_AUDIT"
	DefaultAuditSubject = "outbox_dlq_audit"
)

// RelayRecord is one record of the relay's dead-letter stream: an outbox row
// the relay could not turn into an event (headers Outbox-DLQ-*, body with
// the row, see the README's dead-letter section).
type RelayRecord struct {
	Seq     uint64    `json:"seq"`
	Subject string    `json:"subject"`
	Time    time.Time `json:"time"`
	MsgID   string    `json:"msg_id"`
	// EventID is the dead-lettered event's id, when the row had one; MsgID
	// is the dead-letter record's own id.
	EventID     string              `json:"event_id,omitempty"`
	Table       string              `json:"table"`
	Reason      string              `json:"reason"`
	ReasonClass string              `json:"reason_class"`
	LSN         string              `json:"lsn"`
	CommitLSN   string              `json:"commit_lsn"`
	CommitTime  string              `json:"commit_time"`
	Header      map[string][]string `json:"headers"`
	// Body is the record's JSON body: table, lsn, commit_lsn, commit_time,
	// reason, reason_class, subject and the row's columns under "row".
	Body json.RawMessage `json:"body"`
}

// RelayFilter selects relay records. Zero fields do not filter.
type RelayFilter struct {
	Class     string
	Table     string
	OlderThan time.Duration
	NewerThan time.Duration
	Limit     int
}

// RelayTarget is where the relay keeps its dead letters.
type RelayTarget struct {
	// Stream is the dead-letter stream (the configuration's
	// nats.dead_letter_stream). Default DefaultRelayStream.
	Stream string
	// AuditReplicas is the replicas of the audit stream when the command
	// creates it (the configuration's nats.replicas). Default 1.
	AuditReplicas int
}

// RelayDLQ reads and discards records of the relay's dead-letter stream.
// Discards are audited in a separate stream before the record is deleted.
type RelayDLQ struct {
	js           jetstream.JetStream
	stream       string
	auditStream  string
	auditSubject string
	// auditReplicas is the replicas of an audit stream created here.
	auditReplicas int
	now           func() time.Time
}

// NewRelayDLQ returns access to the dead-letter stream named stream; empty
// names take the defaults.
func NewRelayDLQ(js jetstream.JetStream, stream, auditStream, auditSubject string) *RelayDLQ {
	if stream == "" {
		stream = DefaultRelayStream
	}
	if auditStream == "" {
		auditStream = DefaultAuditStream
	}
	if auditSubject == "" {
		auditSubject = DefaultAuditSubject
	}
	return &RelayDLQ{js: js, stream: stream, auditStream: auditStream, auditSubject: auditSubject, now: time.Now}
}

// Stream returns the dead-letter stream's name.
func (r *RelayDLQ) Stream() string { return r.stream }

func toRelayRecord(seq uint64, subject string, t time.Time, h nats.Header, data []byte) RelayRecord {
	rec := RelayRecord{
		Seq: seq, Subject: subject, Time: t, Header: h,
		MsgID:       h.Get(contract.MsgID),
		EventID:     h.Get(contract.EventID),
		Table:       h.Get(contract.Table),
		Reason:      h.Get(contract.DLQReason),
		ReasonClass: h.Get(contract.DLQReasonClass),
		LSN:         h.Get(contract.DLQLSN),
		CommitLSN:   h.Get(contract.CommitLSN),
		CommitTime:  h.Get(contract.CommitTime),
	}
	if json.Valid(data) {
		rec.Body = data
	} else {
		rec.Body, _ = json.Marshal(string(data))
	}
	// The body repeats the headers; it fills what a header lacks.
	var body struct {
		Table       string `json:"table"`
		LSN         string `json:"lsn"`
		CommitLSN   string `json:"commit_lsn"`
		CommitTime  string `json:"commit_time"`
		Reason      string `json:"reason"`
		ReasonClass string `json:"reason_class"`
		// A long event id is in the body only (no header).
		EventID string `json:"event_id"`
	}
	if json.Unmarshal(data, &body) == nil {
		fill := func(dst *string, v string) {
			if *dst == "" {
				*dst = v
			}
		}
		fill(&rec.Table, body.Table)
		fill(&rec.LSN, body.LSN)
		fill(&rec.CommitLSN, body.CommitLSN)
		fill(&rec.CommitTime, body.CommitTime)
		fill(&rec.Reason, body.Reason)
		fill(&rec.ReasonClass, body.ReasonClass)
		fill(&rec.EventID, body.EventID)
	}
	return rec
}

func (f RelayFilter) match(rec *RelayRecord, now time.Time) bool {
	switch {
	case f.Class != "" && rec.ReasonClass != f.Class:
		return false
	case f.Table != "" && rec.Table != f.Table:
		return false
	case f.OlderThan > 0 && !rec.Time.Before(now.Add(-f.OlderThan)):
		return false
	case f.NewerThan > 0 && rec.Time.Before(now.Add(-f.NewerThan)):
		return false
	}
	return true
}

// List returns the records matching f, oldest first.
func (r *RelayDLQ) List(ctx context.Context, f RelayFilter) ([]RelayRecord, error) {
	var out []RelayRecord
	now := r.now()
	err := r.scan(ctx, r.stream, func(m jetstream.Msg, md *jetstream.MsgMetadata) bool {
		rec := toRelayRecord(md.Sequence.Stream, m.Subject(), md.Timestamp, m.Headers(), m.Data())
		if f.match(&rec, now) {
			out = append(out, rec)
		}
		return f.Limit == 0 || len(out) < f.Limit
	})
	return out, err
}

// scan reads every message of stream in order with an ordered consumer,
// calling fn until it returns false.
func (r *RelayDLQ) scan(ctx context.Context, stream string, fn func(jetstream.Msg, *jetstream.MsgMetadata) bool) error {
	s, err := r.js.Stream(ctx, stream)
	if err != nil {
		return fmt.Errorf("open stream %s: %w", stream, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return fmt.Errorf("read stream %s: %w", stream, err)
	}
	last := info.State.LastSeq
	if info.State.Msgs == 0 {
		return nil
	}
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		return fmt.Errorf("read stream %s: %w", stream, err)
	}
	for {
		batch, err := cons.Fetch(256, jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			return fmt.Errorf("read stream %s: %w", stream, err)
		}
		n := 0
		for m := range batch.Messages() {
			n++
			md, err := m.Metadata()
			if err != nil {
				return fmt.Errorf("read stream %s: %w", stream, err)
			}
			if !fn(m, md) || md.Sequence.Stream >= last || md.NumPending == 0 {
				return nil
			}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) {
			return fmt.Errorf("read stream %s: %w", stream, err)
		}
		if n == 0 {
			return nil // everything after the snapshot was deleted meanwhile
		}
	}
}

// Get returns the record at stream sequence seq.
func (r *RelayDLQ) Get(ctx context.Context, seq uint64) (RelayRecord, error) {
	s, err := r.js.Stream(ctx, r.stream)
	if err != nil {
		return RelayRecord{}, fmt.Errorf("open stream %s: %w", r.stream, err)
	}
	m, err := s.GetMsg(ctx, seq)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return RelayRecord{}, fmt.Errorf("%w: sequence %d of stream %s", ErrNotFound, seq, r.stream)
	}
	if err != nil {
		return RelayRecord{}, fmt.Errorf("read sequence %d of stream %s: %w", seq, r.stream, err)
	}
	return toRelayRecord(m.Sequence, m.Subject, m.Time, m.Header, m.Data), nil
}

// relayAudit is the JSON record of an action on a relay dead letter.
type relayAudit struct {
	At          time.Time `json:"at"`
	Actor       string    `json:"actor"`
	Action      string    `json:"action"`
	Stream      string    `json:"stream"`
	Seq         uint64    `json:"seq"`
	MsgID       string    `json:"msg_id,omitempty"`
	EventID     string    `json:"event_id,omitempty"`
	Table       string    `json:"table,omitempty"`
	ReasonClass string    `json:"reason_class,omitempty"`
	DLQReason   string    `json:"dlq_reason,omitempty"`
	Reason      string    `json:"reason"`
}

// Discard deletes the records at seqs from the dead-letter stream. Each
// discard is first written, with the record's identity and failure, to the
// audit stream and acknowledged there, so no record leaves without a trace.
func (r *RelayDLQ) Discard(ctx context.Context, act Action, seqs []uint64) error {
	if act.Actor == "" {
		return ErrActorRequired
	}
	if strings.TrimSpace(act.Reason) == "" {
		return fmt.Errorf("%w: say why the dead letters may be dropped (--reason)", ErrReasonRequired)
	}
	if len(seqs) == 0 {
		return fmt.Errorf("%w: name the stream sequences to discard", ErrUsage)
	}
	recs := make([]RelayRecord, 0, len(seqs))
	for _, seq := range seqs {
		rec, err := r.Get(ctx, seq)
		if err != nil {
			return err
		}
		recs = append(recs, rec)
	}
	if err := r.ensureAuditStream(ctx); err != nil {
		return err
	}
	s, err := r.js.Stream(ctx, r.stream)
	if err != nil {
		return fmt.Errorf("open stream %s: %w", r.stream, err)
	}
	for _, rec := range recs {
		entry, _ := json.Marshal(relayAudit{At: r.now().UTC(), Actor: act.Actor, Action: ActionDiscard, Stream: r.stream,
			Seq: rec.Seq, MsgID: rec.MsgID, EventID: rec.EventID, Table: rec.Table, ReasonClass: rec.ReasonClass, DLQReason: rec.Reason, Reason: act.Reason})
		// The audit entry and the delete cannot be one transaction. The
		// entry's id names the record, so a second discard of it within the
		// audit stream's duplicate window (another operator at the same
		// time, a rerun after a failed delete) adds no second entry, and a
		// record someone else deleted meanwhile is discarded, not an error.
		m := nats.NewMsg(r.auditSubject)
		m.Header.Set(nats.MsgIdHdr, fmt.Sprintf("discard:%s:%d", r.stream, rec.Seq))
		m.Data = entry
		if _, err := r.js.PublishMsg(ctx, m); err != nil {
			return fmt.Errorf("audit discard of sequence %d: %w", rec.Seq, err)
		}
		if err := s.DeleteMsg(ctx, rec.Seq); err != nil && !gone(ctx, s, rec.Seq) {
			return fmt.Errorf("delete sequence %d of stream %s (the audit entry says it was discarded; run discard again): %w", rec.Seq, r.stream, err)
		}
	}
	return nil
}

// gone reports whether the stream no longer holds seq. nats.go reports a
// failed delete as text only, so the stream is asked instead.
func gone(ctx context.Context, s jetstream.Stream, seq uint64) bool {
	_, err := s.GetMsg(ctx, seq)
	return errors.Is(err, jetstream.ErrMsgNotFound)
}

func (r *RelayDLQ) ensureAuditStream(ctx context.Context) error {
	_, err := r.js.Stream(ctx, r.auditStream)
	if err == nil {
		return nil
	}
	if !errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("open audit stream %s: %w", r.auditStream, err)
	}
	_, err = r.js.CreateStream(ctx, jetstream.StreamConfig{
		Name:        r.auditStream,
		Description: "audit trail of outbox-relay dead-letter actions",
		Subjects:    []string{r.auditSubject},
		Storage:     jetstream.FileStorage,
		Retention:   jetstream.LimitsPolicy,
		// The window in which a repeated discard of one record is
		// recognised (see Discard).
		Duplicates: 10 * time.Minute,
		// As replicated as the streams whose actions it records: an audit
		// trail that one node's loss erases is no trail.
		Replicas: max(r.auditReplicas, 1),
	})
	if err != nil && !errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		// Two operators creating it at once: the server may refuse the
		// second with another error than "already in use" (10049, error
		// creating store); the stream the first created is as good.
		if _, serr := r.js.Stream(ctx, r.auditStream); serr == nil {
			return nil
		}
		return fmt.Errorf("create audit stream %s: %w", r.auditStream, err)
	}
	return nil
}

// Audit returns the audited actions on relay dead letters, oldest first;
// with a Limit, the latest Limit entries.
func (r *RelayDLQ) Audit(ctx context.Context, f AuditFilter) ([]AuditEntry, error) {
	_, err := r.js.Stream(ctx, r.auditStream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, nil // nothing was ever discarded
	}
	var out []AuditEntry
	since := time.Time{}
	if f.Since > 0 {
		since = r.now().Add(-f.Since)
	}
	err = r.scan(ctx, r.auditStream, func(m jetstream.Msg, _ *jetstream.MsgMetadata) bool {
		var a relayAudit
		if json.Unmarshal(m.Data(), &a) != nil || a.At.Before(since) {
			return true
		}
		detail, _ := json.Marshal(map[string]string{"msg_id": a.MsgID, "table": a.Table, "reason_class": a.ReasonClass, "reason": a.DLQReason})
		out = append(out, AuditEntry{At: a.At, Actor: a.Actor, Action: a.Action, Queue: "relay:" + a.Stream,
			Record: int64(a.Seq), EventID: a.EventID, Reason: a.Reason, Detail: detail})
		return true
	})
	if err != nil {
		return nil, err
	}
	if f.Limit > 0 && len(out) > f.Limit {
		out = out[len(out)-f.Limit:]
	}
	return slices.Clip(out), nil
}

func parseSeqs(args []string) ([]uint64, error) {
	seqs := make([]uint64, 0, len(args))
	for _, a := range args {
		n, err := strconv.ParseUint(a, 10, 64)
		if err != nil || n == 0 {
			return nil, fmt.Errorf("%w: %q is not a stream sequence", ErrUsage, a)
		}
		seqs = append(seqs, n)
	}
	return seqs, nil
}
