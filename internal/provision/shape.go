package provision

import (
	"context"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go/jetstream"
)

// ErrDeletesEvents means a stream's configuration deletes stored events
// by itself (consumed, acknowledged, or over a per-subject limit): the
// relay's acks, reconcile's report and cleanup's deletes all trust that a
// stored event stays until the stream's age and size limits remove it.
var ErrDeletesEvents = errors.New("stream deletes stored events")

// ErrLayoutChange means a partition transform would change the layout of
// a stream that holds messages, stranding them on subjects no partition's
// filter matches.
var ErrLayoutChange = errors.New("stream layout change would strand stored events")

// CheckShape checks a stream's configuration for what deletes stored
// events: work-queue or interest retention (an event goes once consumed
// or acknowledged), and max_msgs_per_subject when it discards the
// subject's oldest message (one aggregate's older events vanish, anywhere
// in the stream). Those fail with ErrDeletesEvents and the fix. Settings
// that refuse new events when the stream is full (discard new) come back
// as warnings: the relay then stalls on that stream, loudly.
func CheckShape(cfg jetstream.StreamConfig) (warnings []string, err error) {
	switch cfg.Retention {
	case jetstream.WorkQueuePolicy, jetstream.InterestPolicy:
		return nil, fmt.Errorf("%w: stream %s has %s retention, so an event is deleted once consumed or acknowledged, and reconcile, cleanup and a replay can no longer see it: recreate the stream with limits retention (nats stream add %s --retention limits ...) and move the consumers to it",
			ErrDeletesEvents, cfg.Name, cfg.Retention, cfg.Name)
	}
	if cfg.MaxMsgsPerSubject > 0 {
		if cfg.Discard != jetstream.DiscardNew || !cfg.DiscardNewPerSubject {
			return nil, fmt.Errorf("%w: stream %s keeps %d message(s) per subject and discards the oldest, so an aggregate's earlier events vanish when it gets more: remove the limit (nats stream edit %s --max-msgs-per-subject=-1)",
				ErrDeletesEvents, cfg.Name, cfg.MaxMsgsPerSubject, cfg.Name)
		}
		warnings = append(warnings, fmt.Sprintf("stream %s refuses a subject's message %d and later (max_msgs_per_subject with discard new per subject): the relay stalls on such an aggregate until its messages are removed", cfg.Name, cfg.MaxMsgsPerSubject+1))
	}
	if cfg.Discard == jetstream.DiscardNew && (cfg.MaxMsgs > 0 || cfg.MaxBytes > 0) {
		warnings = append(warnings, fmt.Sprintf("stream %s refuses new messages when full (discard new, max_msgs %d, max_bytes %d): the relay stalls until room is made", cfg.Name, cfg.MaxMsgs, cfg.MaxBytes))
	}
	return warnings, nil
}

// CheckStream reads the stream's configuration and checks it with
// CheckShape. It changes nothing and may be called at any time: setup,
// the relay's start, the tools, and periodically from a running relay,
// since a stream can be edited under it.
func CheckStream(ctx context.Context, js jetstream.JetStream, name string) (warnings []string, err error) {
	s, err := js.Stream(ctx, name)
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", name, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("stream %s info: %w", name, err)
	}
	return CheckShape(info.Config)
}
