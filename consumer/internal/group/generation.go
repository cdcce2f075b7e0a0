package group

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
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
