package reconcile

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/contract"
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
}

// ExpiredBefore returns the occurred-at time before which an event may
// have been removed from the stream's head by its limits (zero when
// nothing was removed): events are stored after their row committed, so
// an event of a row dated skew or more after the first stored message
// cannot have been stored before it.
func (r ScanResult) ExpiredBefore(skew time.Duration) time.Time {
	switch {
	case r.FirstSeq <= 1:
		return time.Time{}
	case r.FirstSeq > r.LastSeq: // everything stored was removed
		return r.LastTime.Add(skew)
	}
	return r.FirstTime.Add(skew)
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

// SubjectMatches reports whether subject matches one of the filters (NATS
// wildcards: '*' one token, '>' the rest).
func SubjectMatches(subject string, filters []string) bool {
	for _, f := range filters {
		if subjectMatch(subject, f) {
			return true
		}
	}
	return false
}

func subjectMatch(subject, filter string) bool {
	for {
		ft, frest, fmore := strings.Cut(filter, ".")
		st, srest, smore := strings.Cut(subject, ".")
		switch {
		case ft == ">":
			return true
		case ft != "*" && ft != st:
			return false
		case !fmore || !smore:
			return fmore == smore
		}
		filter, subject = frest, srest
	}
}
