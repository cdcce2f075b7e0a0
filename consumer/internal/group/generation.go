package group

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/consumer/internal/observe"
	"github.com/outbox-relay/outbox-relay/contract"
)

// fence sets the until of gen, the oldest generation not drained, which
// drains while newer ones wait: the least of lastSeq (read with a newer
// count) and the newer generations' from. Each is a stream sequence read
// after the change away from gen's count, with every message of gen's
// count up to it stored before the change; one of gen's count beyond it
// was stored after the count went back to gen's, behind events of a newer
// count that are not consumed yet. So none is consumed (partition.admit),
// and when one exists the change back is refused with the fix.
func (g *Member) fence(ctx context.Context, gens map[int]*generation, gen *generation, lastSeq uint64) error {
	gen.until = lastSeq
	for n, other := range gens {
		if n != gen.partitions && other.fromKnown {
			gen.until = min(gen.until, other.from)
		}
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	msg, err := g.strm.GetMsg(ctx, gen.until+1, jetstream.WithGetMsgSubject(generationFilter(g.source, gen.partitions)))
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return nil
	case err != nil:
		return fmt.Errorf("look for %d-partition events stored after the partition count changed: %w", gen.partitions, err)
	}
	return fmt.Errorf("%w: the stream's partition count went back to %d while the %d-partition durables of group %s were draining: %s (stream sequence %d) was stored after events of a newer count that are not consumed yet, so nothing is consumed; set nats.partitions to the count the stream had before, run `outbox-relay setup`, and change the count only once the %d-partition durables are gone (docs/consumer.md \"Changing the number of partitions\")",
		ErrMismatch, gen.partitions, gen.partitions, g.cfg.Name, msg.Subject, msg.Sequence, gen.partitions)
}

// EnsureDurable creates or checks a partition durable through the host;
// tests make it fail.
var EnsureDurable = func(ctx context.Context, host Host, cfg jetstream.ConsumerConfig, update bool) (jetstream.Consumer, error) {
	return host.EnsureDurable(ctx, cfg, update)
}

// retryTimeouts runs f until it succeeds, fails otherwise than by a
// JetStream request timing out (a loaded or restarting server answers
// late; a member must not exit for that), or ctx ends.
func (g *Member) retryTimeouts(ctx context.Context, what string, f func() error) error {
	var failing observe.LoopHealth
	for {
		err := f()
		if err == nil || ctx.Err() != nil || !timedOut(err) {
			if err == nil {
				failing.Report(g.log, what, nil)
			}
			return err
		}
		failing.Report(g.log, what, err)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

// timedOut reports whether err is a JetStream request that got no answer
// in time.
func timedOut(err error) bool {
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, nats.ErrTimeout)
}

// strays refuses (ErrMismatch) when the stream holds events of the group's
// source under a partition count that has no durables, stored after the
// oldest generation's durables began (the greatest from of its durables:
// every change away from its count came after it). Such a count was set
// and changed back while no member read the stream (every member stopped,
// or both changes within one step), so no durable will ever deliver its
// events, and consuming the current count would apply what was stored
// after them first. A member's first step checks before anything is
// consumed; later steps every straysInterval, after a count change they
// saw, and at each step while refusing.
func (g *Member) strays(ctx context.Context, gens map[int]*generation, current int) error {
	since, known := oldestFrom(gens, 0)
	if !known {
		return nil // durables of an earlier version: nothing to measure from
	}
	filters := make([]string, 0, contract.MaxPartitions)
	for n := 1; n <= contract.MaxPartitions; n++ {
		if _, ok := gens[n]; !ok && n != current {
			filters = append(filters, generationFilter(g.source, n))
		}
	}
	seq, subject, err := g.firstOf(ctx, filters, since+1)
	if err != nil || seq == 0 {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	n, _, _ := contract.SubjectPartition(g.source, subject)
	if info, err := g.strm.Info(ctx); err != nil {
		return fmt.Errorf("stream %s info: %w", g.cfg.Stream, err)
	} else if g.countIs(info, n) {
		// The count changed to n since this step's stream info: the next
		// step creates its durables. This one must not assign: it would
		// give out the count it read, whatever of it was stored after n's
		// events included.
		return errCountChanged
	}
	g.markDraining(n)
	fix := fmt.Sprintf("no event of the %d-partition count was stored after it, so set nats.partitions to %d, run `outbox-relay setup` and restart the members with Group.Partitions %d: the %d-partition durables drain first, then the %d-partition ones, in order",
		current, n, n, current, n)
	after, err := g.strm.GetMsg(ctx, seq+1, jetstream.WithGetMsgSubject(generationFilter(g.source, current)))
	switch {
	case err == nil:
		fix = fmt.Sprintf("events of the %d-partition count were stored after it too (stream sequence %d), so neither count consumes both in order: stop the relay and recover by hand (docs/consumer.md \"Changing the number of partitions\")",
			current, after.Sequence)
	case !errors.Is(err, jetstream.ErrMsgNotFound):
		return fmt.Errorf("look for %d-partition events stored after %d-partition ones: %w", current, n, err)
	}
	return fmt.Errorf("%w: stream %s holds %s (stream sequence %d), stored under %d partitions after the durables of group %s began (stream sequence %d), and no durable of the group filters that count: the count was changed to %d and back while no member ran, so those events would never be applied and nothing is consumed; %s",
		ErrMismatch, g.cfg.Stream, subject, seq, n, g.cfg.Name, since, n, fix)
}

// strayFilters is how many filter subjects one consumer of firstOf
// holds. The server checks a new consumer's filters against each other
// for overlap, so its work grows with their square: one consumer with a
// filter for every count without durables (up to MaxPartitions − 1) took
// the test server 0.7 to 2.5 s beside six busy loops (with -race), more
// than the 10 s deadline when the test ran at a lower priority, and a
// member whose look times out at every step never gets its first
// assignment (TestGroupHandOffUnpinsNewOwner: "timed out after 30s
// waiting for a applied", every step "look for events under partition
// counts without durables: context deadline exceeded"). Sixteen
// consumers of 64 filters took 0.14 to 0.22 s in all there.
const strayFilters = 64

// firstOf returns the stream sequence and subject of the first message at
// or after start that matches one of filters (0 when there is none),
// looking through strayFilters of them at a time (firstOfFew).
func (g *Member) firstOf(ctx context.Context, filters []string, start uint64) (uint64, string, error) {
	var seq uint64
	var subject string
	for few := range slices.Chunk(filters, strayFilters) {
		s, subj, err := g.firstOfFew(ctx, few, start)
		if err != nil {
			return 0, "", err
		}
		if s != 0 && (seq == 0 || s < seq) {
			seq, subject = s, subj
		}
	}
	return seq, subject, nil
}

// firstOfFew is firstOf through one ephemeral consumer that is never
// acknowledged and deleted at once: unlike GetMsg it takes many filters,
// and its pending count costs the server a walk of the matching subjects
// only. Each look has a deadline of its own, so that a loaded server
// that answers every small look in time is not refused for the sum.
func (g *Member) firstOfFew(ctx context.Context, filters []string, start uint64) (uint64, string, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	cons, err := g.strm.CreateConsumer(ctx, jetstream.ConsumerConfig{
		Description:       "outbox-relay consumer group " + g.cfg.Name + ": events under a partition count without durables",
		DeliverPolicy:     jetstream.DeliverByStartSequencePolicy,
		OptStartSeq:       start,
		AckPolicy:         jetstream.AckNonePolicy,
		FilterSubjects:    filters,
		MemoryStorage:     true,
		InactiveThreshold: time.Minute, // should this member die before the delete
	})
	if err != nil {
		return 0, "", fmt.Errorf("look for events under partition counts without durables: %w", err)
	}
	defer func() {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = g.strm.DeleteConsumer(dctx, cons.CachedInfo().Name) // else gone after InactiveThreshold
	}()
	if cons.CachedInfo().NumPending == 0 {
		return 0, "", nil
	}
	msg, err := cons.Next(jetstream.FetchMaxWait(5 * time.Second))
	if err != nil {
		return 0, "", fmt.Errorf("read the first event under a partition count without durables: %w", err)
	}
	md, err := msg.Metadata()
	if err != nil {
		return 0, "", fmt.Errorf("read the first event under a partition count without durables: %w", err)
	}
	return md.Sequence.Stream, msg.Subject(), nil
}

// straysInterval is how often a consuming member looks for strays: the
// look costs the server tens of milliseconds (a consumer with a filter per
// partition count), so not at every step.
const straysInterval = time.Minute

// oldestFrom is the least of the generations' greatest from, but for the
// generation of partitions: every change away from their counts came
// after it. known is false when no generation records its from.
func oldestFrom(gens map[int]*generation, partitions int) (since uint64, known bool) {
	since = math.MaxUint64
	for n, gen := range gens {
		if gen.fromKnown && n != partitions {
			since, known = min(since, gen.fromMax), true
		}
	}
	return since, known
}

// generationFrom is the from of partitions' durables, created when the
// stream's info showed lastSeq with that count: lastSeq, unless the count
// began earlier, while no member read the stream (every member stopped
// when it changed), and events of it are stored already; then just
// before the first of them, so that an older generation drains only what
// was stored before the count began (fence).
func (g *Member) generationFrom(ctx context.Context, partitions int, lastSeq uint64) (uint64, error) {
	gens, err := g.generations(ctx)
	if err != nil {
		return 0, err
	}
	since, known := oldestFrom(gens, partitions)
	if !known || since >= lastSeq {
		return lastSeq, nil
	}
	seq, err := g.firstEventOf(ctx, partitions, since+1)
	switch {
	case err != nil:
		return 0, fmt.Errorf("look for %d-partition events stored before its durables: %w", partitions, err)
	case seq == 0:
		return lastSeq, nil
	}
	return min(lastSeq, seq-1), nil
}

// firstEventOf is the stream sequence of the first event stored under the
// partition count partitions at or after from, 0 when there is none.
func (g *Member) firstEventOf(ctx context.Context, partitions int, from uint64) (uint64, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	msg, err := g.strm.GetMsg(ctx, from, jetstream.WithGetMsgSubject(generationFilter(g.source, partitions)))
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return 0, nil
	case err != nil:
		return 0, err
	}
	return msg.Sequence, nil
}

// errCountChanged ends a step that found the stream's partition count
// changed since it read the stream's info: the next step starts over.
var errCountChanged = errors.New("the stream's partition count changed during the step")

// countIs reports whether the stream's info shows the partition count n.
func (g *Member) countIs(info *jetstream.StreamInfo, n int) bool {
	_, current, err := StreamPartitions(info.Config)
	return err == nil && current == n
}
