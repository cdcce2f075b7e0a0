package reconcile

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/contract"
	"github.com/outbox-relay/outbox-relay/internal/provision"
)

// StreamEvent is what a scan reports of one stored message: its headers'
// identity fields, not its payload.
type StreamEvent struct {
	Seq     uint64
	Stored  time.Time // the server's timestamp
	Subject string
	// EventID is Outbox-Event-Id, else Nats-Msg-Id.
	EventID       string
	Table         string
	AggregateType string
	AggregateID   string
	Version       string
	// OccurredAt is Outbox-Occurred-At; zero when absent or malformed.
	OccurredAt time.Time
	CommitLSN  string
}

// scanBatch is how many messages one fetch asks for.
const scanBatch = 2000

// ScanFrom says where a scan starts: at sequence Seq when it is set, else
// at the first message stored at or after Time, else at the beginning.
type ScanFrom struct {
	Time time.Time
	Seq  uint64
}

// ScanResult is the extent of a scan.
type ScanResult struct {
	// Messages is the messages read.
	Messages uint64
	// LastSeq is the stream's last sequence when the scan began: the scan
	// covered everything up to it, and a later scan of the tail starts
	// after it.
	LastSeq uint64
	// FirstSeq and FirstTime are the stream's first stored message when
	// the scan began, LastTime its last one's storage time. FirstSeq above
	// 1 means messages were removed from the stream's head (max_age,
	// max_msgs, max_bytes, a purge).
	FirstSeq            uint64
	FirstTime, LastTime time.Time
	// Limits are the stream's limits that remove stored events, and At
	// when the scan began: what ExpiredBefore may blame a removal on.
	Limits Limits
	At     time.Time
	// Layout is how the stream stores events (its subject transform).
	Layout contract.Layout
}

// Limits are the limits of a stream that remove stored events from its
// head: max_age, max_msgs, max_bytes (limits retention).
type Limits struct {
	MaxAge            time.Duration
	MaxMsgs, MaxBytes int64
}

func limitsOf(cfg jetstream.StreamConfig) Limits {
	return Limits{MaxAge: cfg.MaxAge, MaxMsgs: cfg.MaxMsgs, MaxBytes: cfg.MaxBytes}
}

// ExpiredBefore returns the occurred-at time before which an event may
// have been removed from the stream's head by its limits; zero when the
// limits explain no removal. Only the limits can: a stream without any
// that lost its first messages lost them by hand (a delete, a purge), and
// their rows are missing, to be repaired. With max_age alone, only events
// older than it can have expired. Events are stored after their row
// committed, so a row dated skew or more after the newest event the limits
// may have removed cannot have been stored before it. A stream emptied by
// its limits removed nothing stored after its last message.
func (r ScanResult) ExpiredBefore(skew time.Duration) time.Time {
	l := r.Limits
	if r.FirstSeq <= 1 || (l.MaxAge <= 0 && l.MaxMsgs <= 0 && l.MaxBytes <= 0) {
		return time.Time{}
	}
	head := r.FirstTime
	if r.FirstSeq > r.LastSeq { // everything stored was removed
		head = r.LastTime
	}
	if l.MaxMsgs <= 0 && l.MaxBytes <= 0 {
		// Age alone: a message younger than max_age was removed by hand.
		if aged := r.At.Add(-l.MaxAge); aged.Before(head) {
			head = aged
		}
	}
	return head.Add(skew)
}

// ScanStream calls fn for every message of stream matching filters (all when
// empty) from the position from, up to the stream's last sequence when the
// scan begins. It reads headers only, through an ephemeral consumer that is
// deleted afterwards (and expires on its own if the process dies).
func ScanStream(ctx context.Context, js jetstream.JetStream, stream string, filters []string, from ScanFrom, fn func(*StreamEvent) error) (ScanResult, error) {
	var res ScanResult
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return res, fmt.Errorf("stream %s: %w", stream, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return res, fmt.Errorf("stream %s info: %w", stream, err)
	}
	last := info.State.LastSeq
	res.LastSeq = last
	res.FirstSeq, res.FirstTime, res.LastTime = info.State.FirstSeq, info.State.FirstTime, info.State.LastTime
	res.Limits, res.At, res.Layout = limitsOf(info.Config), info.TimeStamp, provision.StreamLayout(info.Config)
	if res.At.IsZero() { // a server that does not say
		res.At = time.Now()
	}
	if info.State.Msgs == 0 || last == 0 || (from.Seq > 0 && from.Seq > last) {
		return res, nil
	}
	cc := jetstream.ConsumerConfig{
		AckPolicy:         jetstream.AckNonePolicy,
		HeadersOnly:       true,
		MemoryStorage:     true,
		InactiveThreshold: time.Minute,
		DeliverPolicy:     jetstream.DeliverAllPolicy,
		Description:       "outbox-relay reconcile scan",
	}
	switch {
	case from.Seq > 0:
		cc.DeliverPolicy, cc.OptStartSeq = jetstream.DeliverByStartSequencePolicy, from.Seq
	case !from.Time.IsZero():
		st := from.Time.UTC()
		cc.DeliverPolicy, cc.OptStartTime = jetstream.DeliverByStartTimePolicy, &st
	}
	switch len(filters) {
	case 0:
	case 1:
		cc.FilterSubject = filters[0]
	default:
		cc.FilterSubjects = filters
	}
	cons, err := s.CreateConsumer(ctx, cc)
	if err != nil {
		return res, fmt.Errorf("create scan consumer on %s: %w", stream, err)
	}
	name := cons.CachedInfo().Name
	defer func() {
		dctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = s.DeleteConsumer(dctx, name)
	}()
	if cons.CachedInfo().NumPending == 0 {
		return res, nil
	}
	n := &res.Messages
	var ev StreamEvent
	for {
		if err := ctx.Err(); err != nil {
			return res, err
		}
		// Stored messages are all available at once: a no-wait request
		// returns them without waiting out an expiry.
		batch, err := cons.FetchNoWait(scanBatch)
		if err != nil {
			return res, fmt.Errorf("scan %s: %w", stream, err)
		}
		got, done := 0, false
		for m := range batch.Messages() {
			got++
			if done {
				continue // drain the batch
			}
			md, err := m.Metadata()
			if err != nil {
				return res, fmt.Errorf("scan %s: %w", stream, err)
			}
			if md.Sequence.Stream > last {
				done = true
				continue
			}
			h := m.Headers()
			ev = StreamEvent{
				Seq:           md.Sequence.Stream,
				Stored:        md.Timestamp,
				Subject:       m.Subject(),
				EventID:       h.Get(contract.EventID),
				Table:         h.Get(contract.Table),
				AggregateType: h.Get(contract.AggregateType),
				AggregateID:   h.Get(contract.AggregateID),
				Version:       h.Get(contract.AggregateVersion),
				CommitLSN:     h.Get(contract.CommitLSN),
			}
			if ev.EventID == "" {
				ev.EventID = h.Get(contract.MsgID)
			}
			if s := h.Get(contract.OccurredAt); s != "" {
				ev.OccurredAt, _ = time.Parse(time.RFC3339Nano, s)
			}
			*n++
			if err := fn(&ev); err != nil {
				return res, err
			}
			if md.NumPending == 0 || md.Sequence.Stream >= last {
				done = true
			}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) {
			return res, fmt.Errorf("scan %s: %w", stream, err)
		}
		if done {
			return res, nil
		}
		if got == 0 {
			// Nothing within the wait: either the filtered tail is empty
			// (nothing pending) or the server is slow; ask.
			ci, err := cons.Info(ctx)
			if err != nil {
				return res, fmt.Errorf("scan %s: %w", stream, err)
			}
			if ci.NumPending == 0 {
				return res, nil
			}
		}
	}
}
