package reconcile

import (
	"context"
	"errors"
	"fmt"
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

// ScanStream calls fn for every message of stream matching filters (all when
// empty) stored at or after start (the whole stream when start is zero), up
// to the stream's last sequence when the scan begins. It reads headers only,
// through an ephemeral consumer that is deleted afterwards (and expires on
// its own if the process dies). It returns the number of messages read.
func ScanStream(ctx context.Context, js jetstream.JetStream, stream string, filters []string, start time.Time, fn func(*StreamEvent) error) (uint64, error) {
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return 0, fmt.Errorf("stream %s: %w", stream, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0, fmt.Errorf("stream %s info: %w", stream, err)
	}
	last := info.State.LastSeq
	if info.State.Msgs == 0 || last == 0 {
		return 0, nil
	}
	cc := jetstream.ConsumerConfig{
		AckPolicy:         jetstream.AckNonePolicy,
		HeadersOnly:       true,
		MemoryStorage:     true,
		InactiveThreshold: time.Minute,
		DeliverPolicy:     jetstream.DeliverAllPolicy,
		Description:       "outbox-relay reconcile scan",
	}
	if !start.IsZero() {
		st := start.UTC()
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
		return 0, fmt.Errorf("create scan consumer on %s: %w", stream, err)
	}
	name := cons.CachedInfo().Name
	defer func() {
		dctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = s.DeleteConsumer(dctx, name)
	}()
	if cons.CachedInfo().NumPending == 0 {
		return 0, nil
	}
	var n uint64
	var ev StreamEvent
	for {
		if err := ctx.Err(); err != nil {
			return n, err
		}
		batch, err := cons.Fetch(scanBatch, jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			return n, fmt.Errorf("scan %s: %w", stream, err)
		}
		got, done := 0, false
		for m := range batch.Messages() {
			got++
			if done {
				continue // drain the batch
			}
			md, err := m.Metadata()
			if err != nil {
				return n, fmt.Errorf("scan %s: %w", stream, err)
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
			n++
			if err := fn(&ev); err != nil {
				return n, err
			}
			if md.NumPending == 0 || md.Sequence.Stream >= last {
				done = true
			}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) {
			return n, fmt.Errorf("scan %s: %w", stream, err)
		}
		if done {
			return n, nil
		}
		if got == 0 {
			// Nothing within the wait: either the filtered tail is empty
			// (nothing pending) or the server is slow; ask.
			ci, err := cons.Info(ctx)
			if err != nil {
				return n, fmt.Errorf("scan %s: %w", stream, err)
			}
			if ci.NumPending == 0 {
				return n, nil
			}
		}
	}
}
