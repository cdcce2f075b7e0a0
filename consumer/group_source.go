package consumer

import (
	"context"
	"maps"
	"sync/atomic"

	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/consumer/internal/group"
)

// groupSource is the source of a consumer group member: the partitions the
// member (consumer/internal/group) owns, each pulled through a feed of the
// engine. The member knows the engine only as a group.Host.
type groupSource struct {
	c      *Consumer
	m      *group.Member
	id     identity               // set by setUp
	budget atomic.Pointer[budget] // set by run; the workers read it in gone
}

func (c *Consumer) newGroupSource(strm jetstream.Stream) *groupSource {
	g := c.cfg.Group
	cfg := group.Config{
		Name: c.cfg.Name, Stream: c.cfg.Stream, Member: g.Member, Partitions: g.Partitions,
		MemberTTL: g.MemberTTL, PinnedTTL: g.PinnedTTL, DrainTimeout: g.DrainTimeout,
		AckWait: c.cfg.AckWait, MaxAckPending: c.cfg.MaxAckPending, VersionCheck: c.cfg.VersionCheck,
		Durable: c.consumerConfig(),
	}
	return &groupSource{c: c, m: group.New(cfg, c.js, strm, c.log, c.reg)}
}

// setUp reads the identity the member records in its partition durables;
// the member sets itself up in run (group.Member.Run).
func (s *groupSource) setUp(ctx context.Context) error {
	id, err := s.c.identity(ctx)
	s.id = id
	return err
}

func (s *groupSource) run(ctx, settleCtx context.Context, e *engine) error {
	h := &groupHost{e: e, id: s.id, log: s.c.log.With(zap.String("member", s.c.cfg.Group.Member)),
		budget: newBudget(s.c.cfg.MaxAckPending)}
	s.budget.Store(h.budget)
	if hookGroupBudget != nil {
		hookGroupBudget(s.c.cfg.Group.Member, h.budget)
	}
	return s.m.Run(ctx, settleCtx, h)
}

// hookGroupBudget, set by tests, is given each member's budget as its run
// begins.
var hookGroupBudget func(member string, b *budget)

// gone reports which retried messages need no redelivery (group.Member.Gone);
// the slots of those naked for a retry come back to the budget, since
// their redeliveries will not.
func (s *groupSource) gone(ctx context.Context, seqs []uint64) map[uint64]bool {
	gone := s.m.Gone(ctx, seqs)
	var left []uint64
	for seq, ok := range gone {
		if ok {
			left = append(left, seq)
		}
	}
	s.forget(left)
	return gone
}

// forget gives the budget slots of the naked messages at seqs back
// (budget.forget): their redeliveries, if any, take slots of their own.
func (s *groupSource) forget(seqs []uint64) {
	b := s.budget.Load()
	for _, seq := range seqs {
		b.forget(seq)
	}
}

// errSetUpCancelled ends a source's run whose ctx ended before the source
// was set up (a group member before its first assignment): engine.run
// returns it, since nothing ran, where other errors after ctx ended are a
// shutdown.
var errSetUpCancelled = group.ErrSetUpCancelled

// groupHost is the engine as a group member sees it.
type groupHost struct {
	e      *engine
	id     identity // of this consumer: its database; the filter is per partition
	log    *zap.Logger
	budget *budget // MaxAckPending, shared by the member's partitions
}

// Feed opens a feed on a partition durable, sharing the member's budget;
// admit is asked about each delivery's stream sequence before it is handed on.
func (h *groupHost) Feed(cons jetstream.Consumer, name string, admit func(streamSeq uint64) error, opts ...jetstream.PullMessagesOpt) group.Feed {
	f := newFeed(h.e, cons, name, h.log, opts...)
	f.budget = h.budget
	f.admitSeq = admit
	h.budget.join(f)
	return &partitionFeed{e: h.e, f: f}
}

// EnsureDurable records this consumer's identity in the partition
// durable's metadata and checks it on one that exists (ensureDurable).
func (h *groupHost) EnsureDurable(ctx context.Context, cfg jetstream.ConsumerConfig, update bool) (jetstream.Consumer, error) {
	id := h.id
	id.filter = cfg.FilterSubject
	cfg.Metadata = maps.Clone(cfg.Metadata)
	if cfg.Metadata == nil {
		cfg.Metadata = map[string]string{}
	}
	cfg.Metadata[metaDatabase], cfg.Metadata[metaFilter] = id.database(), id.filter
	return h.e.c.ensureDurable(ctx, cfg, id, update)
}

// partitionFeed is a feed as a group.Feed.
type partitionFeed struct {
	e *engine
	f *feed
}

func (p *partitionFeed) Pump(ctx context.Context) error   { return p.e.pump(ctx, p.f) }
func (p *partitionFeed) Stop()                            { p.f.stop() }
func (p *partitionFeed) Close()                           { p.f.close() }
func (p *partitionFeed) Settle(ctx context.Context) error { return p.f.settle(ctx) }
func (p *partitionFeed) Unsettled() int                   { return p.f.unsettled() }
func (p *partitionFeed) Pin() string                      { return p.f.pin }
