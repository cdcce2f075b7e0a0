package group

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/consumer/internal/observe"

	"github.com/outbox-relay/outbox-relay/contract"
)

// Member is the member side of a consumer group during one Run of the
// consumer: the heartbeat, the assignment of partitions and the partitions
// pulled. Make it with [New]; the engine runs it as a source.
type Member struct {
	cfg      Config
	js       jetstream.JetStream
	reg      prometheus.Registerer // for the member's metrics
	host     Host                  // set by Run: whose workers the partitions feed
	strm     jetstream.Stream
	ttl      time.Duration // the bucket's member TTL
	replicas int           // of the bucket, when it must be created again
	startSeq uint64        // the stream's last sequence when Run began

	// The bucket is opened again (created if missing: a memory bucket of
	// an earlier version does not survive a NATS restart) by the heartbeat
	// goroutine when a put fails, and read by the roster's watch; rewatch
	// tells the watch to start over on the new one.
	kvMu    sync.Mutex
	kv      jetstream.KeyValue
	kvOpens uint64 // openings of the bucket: a reopening restarts the watch
	rewatch chan struct{}
	restale chan error // the heartbeat tells the watch why it is stale

	source  string // the stream subject the partition transform applies to
	current int    // the stream's partition count, as last read
	log     *zap.Logger
	met     *metrics

	parts    map[string]*partition // by durable, owned by the coordinator loop
	wg       sync.WaitGroup        // partition goroutines
	errs     chan error            // a partition that cannot go on
	assigned []int                 // last assignment, for rebalance counting
	// The heartbeat has a goroutine of its own (beat), so that a slow
	// step (JetStream API requests queue behind a busy server) cannot
	// delay it past the TTL and make the others drop this member: it
	// writes beatCount (set by the coordinator loop), lastBeat and
	// beatErr.
	beatCount   atomic.Int64
	lastBeat    atomic.Int64 // unix ns of the last successful heartbeat
	beatErr     atomic.Pointer[error]
	lastOwner   map[string]time.Time // durable -> when it last had an owner or nothing pending
	drainLogged time.Time            // reportDraining's last report
	drainSince  time.Time            // since an older generation blocks the current one
	straysDue   time.Time            // when the coordinator loop looks for strays next

	roster *roster // the live members, kept by watchRoster
	// started is set by the first assignment (of the coordinator loop,
	// read by Run after it returned).
	started bool
}

// memberInfo is a member's heartbeat value.
type memberInfo struct {
	id         string
	partitions int
}

// New returns a member of the group cfg.Name, consuming strm through js;
// log is the consumer's logger, reg the registerer of its metrics
// ([RegisterMetrics] must have accepted it). It starts nothing.
func New(cfg Config, js jetstream.JetStream, strm jetstream.Stream, log *zap.Logger, reg prometheus.Registerer) *Member {
	return &Member{cfg: cfg, js: js, strm: strm, log: log.With(zap.String("member", cfg.Member)), reg: reg}
}

// Run checks the stream, joins the group, creates the partition durables,
// and until ctx ends keeps pulling the partitions assigned to it into
// host's feeds. On shutdown it leaves the group at once rather than after
// the member TTL, and hands its partitions off: the host's workers, on
// settleCtx, which outlives ctx, settle what is in flight. Run returns
// after every goroutine it started has returned.
//
// A ctx that ends before the member's first assignment is an error, not a
// shutdown (ErrSetUpCancelled wrapping ctx's error): the member never
// consumed.
func (g *Member) Run(ctx, settleCtx context.Context, host Host) error {
	err := g.run(ctx, settleCtx, host)
	if cerr := ctx.Err(); cerr != nil && !g.started {
		if err != nil && !errors.Is(err, cerr) {
			return fmt.Errorf("%w: group %s before its first assignment: %w: %w", ErrSetUpCancelled, g.cfg.Name, cerr, err)
		}
		return fmt.Errorf("%w: group %s before its first assignment: %w", ErrSetUpCancelled, g.cfg.Name, cerr)
	}
	return err
}

func (g *Member) run(ctx, settleCtx context.Context, host Host) error {
	if err := g.setUp(ctx, host); err != nil {
		return err
	}
	// The roster is read by the join's agreement check and by every step
	// until run returns.
	rctx, stopRoster := context.WithCancel(ctx)
	var rosterWG sync.WaitGroup
	rosterWG.Go(func() { g.watchRoster(rctx) })
	defer rosterWG.Wait()
	defer stopRoster()
	if err := g.join(ctx); err != nil {
		return err
	}
	if err := g.retryTimeouts(ctx, "create the partition durables", func() error {
		from, err := g.generationFrom(ctx, g.current, g.startSeq)
		if err != nil {
			return err
		}
		return g.ensureGeneration(ctx, g.current, from, true)
	}); err != nil {
		return err
	}
	cfg := &g.cfg
	g.log.Info("consuming as a group member", zap.String("stream", cfg.Stream),
		zap.Int("partitions", g.current), zap.Duration("pinned_ttl", cfg.PinnedTTL),
		zap.Duration("member_ttl", g.ttl), zap.Bool("version_check", cfg.VersionCheck))
	// The partitions pull on the workers' context, so that the hand-off at
	// shutdown can settle; they stop with Run.
	pctx, stopParts := context.WithCancel(settleCtx)
	defer g.wg.Wait()
	defer stopParts()
	err := g.coordinate(ctx, pctx)
	g.shutdown()
	return err
}

// setUp reads the stream's partitioning and opens the member bucket.
func (g *Member) setUp(ctx context.Context, host Host) error {
	cfg := &g.cfg
	info, err := g.strm.Info(ctx)
	if err != nil {
		return fmt.Errorf("stream %s info: %w", cfg.Stream, err)
	}
	if g.source, g.current, err = cfg.checkStream(info); err != nil {
		return err
	}
	g.startSeq = info.State.LastSeq
	if g.met, err = newMetricsOf(g.reg, cfg.Name); err != nil {
		return err
	}
	g.host = host
	g.parts = map[string]*partition{}
	g.errs = make(chan error, 1)
	g.lastOwner = map[string]time.Time{}
	g.roster = newRoster(cfg.Member)
	g.rewatch = make(chan struct{}, 1)
	g.restale = make(chan error, 1)
	g.replicas = max(info.Config.Replicas, 1)
	g.beatCount.Store(int64(g.current))
	return g.openBucket(ctx)
}

// connReconnects is how many times the member's NATS connection has
// reconnected.
func (g *Member) connReconnects() uint64 {
	if nc := g.js.Conn(); nc != nil {
		return nc.Stats().Reconnects
	}
	return 0
}

// openBucket opens (creating it if needed) the group's member bucket. It
// is file storage, so that the members survive a restart of a single NATS
// server; a bucket created by an earlier version (memory) is used as it is,
// and created again as file storage when a restart lost it.
func (g *Member) openBucket(ctx context.Context) error {
	cfg := &g.cfg
	bucket := Bucket(cfg.Name)
	kv, err := g.js.CreateKeyValue(ctx, jetstream.KeyValueConfig{
		Bucket:      bucket,
		Description: "outbox-relay consumer group members (heartbeats)",
		TTL:         cfg.MemberTTL,
		History:     1,
		Storage:     jetstream.FileStorage,
		Replicas:    g.replicas,
	})
	if errors.Is(err, jetstream.ErrBucketExists) {
		kv, err = g.js.KeyValue(ctx, bucket)
	}
	if err != nil {
		return fmt.Errorf("open group bucket %s: %w", bucket, err)
	}
	st, err := kv.Status(ctx)
	if err != nil {
		return fmt.Errorf("group bucket %s status: %w", bucket, err)
	}
	if st.TTL() <= 0 {
		return fmt.Errorf("%w: group bucket %s has no TTL, so dead members would never leave; delete the bucket (nats kv del %s) and restart the members", ErrMismatch, bucket, bucket)
	}
	g.kvMu.Lock()
	reopened := g.kv != nil
	g.kv = kv
	g.kvOpens++
	if !reopened {
		g.ttl = st.TTL()
	}
	g.kvMu.Unlock()
	if reopened {
		select {
		case g.rewatch <- struct{}{}:
		default:
		}
	}
	return nil
}

// bucket is the member bucket as last opened.
func (g *Member) bucket() jetstream.KeyValue {
	g.kvMu.Lock()
	defer g.kvMu.Unlock()
	return g.kv
}

// bucketOpens is how many times the bucket was opened so far.
func (g *Member) bucketOpens() uint64 {
	g.kvMu.Lock()
	defer g.kvMu.Unlock()
	return g.kvOpens
}

// join checks that the live members agree on the partition count, then
// heartbeats once.
//
// A member of this group heartbeats the count its last step read, so
// after a partition-count change it reports the old count until its next
// step, and on a starved machine a step comes many seconds late (seen: 12 s
// against a TTL of 3 s). Only a count this group has no claim to on this
// stream is a mismatch (agree), and even that is waited for one member TTL
// from when a mismatch is first seen: a member may have read a change
// whose durables it has not created yet. Answers that have not come yet
// (unanswered: a request timed out, JetStream is unavailable for now, the
// roster's watch is still starting) decide nothing: join waits for them as
// long as ctx lasts, as the member's steps would. Any other failure, such
// as a watch the server refuses, ends join one member TTL after it is
// first met (members itself waits up to a TTL for the roster first).
func (g *Member) join(ctx context.Context) error {
	// A failure that decides ends join one TTL after the first of its
	// kind (a mismatch, or another): a watch refused for a while must not
	// use up the time a member on another count has to move on.
	var since time.Time
	var sinceMismatch bool
	var failing observe.LoopHealth
	logged := &joinLog{others: map[memberInfo]bool{}}
	for {
		err := g.agree(ctx, logged)
		if err == nil {
			failing.Report(g.log, "join the group", nil)
			break
		}
		if ctx.Err() != nil {
			return err
		}
		if unanswered(err) {
			failing.Report(g.log, "join the group", err)
		} else if mismatch := errors.Is(err, ErrMismatch); since.IsZero() || mismatch != sinceMismatch {
			since, sinceMismatch = time.Now(), mismatch
		} else if time.Since(since) > g.ttl {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(250 * time.Millisecond):
		}
	}
	return g.heartbeat(ctx)
}

// unanswered reports whether err says only that an answer has not come
// yet: a JetStream request timed out or JetStream is unavailable for now,
// or the roster's watch has not read the bucket and has not been refused
// (it is starting, or it timed out, ended or was started anew).
func unanswered(err error) bool {
	if timedOut(err) || unavailable(err) {
		return true
	}
	// members returns errRosterNotReady itself while no watch has ended,
	// and wraps why the last one did otherwise (roster.notRead).
	return err == errRosterNotReady ||
		errors.Is(err, errRosterNotReady) && (errors.Is(err, errWatchEnded) || errors.Is(err, errBucketReopened) || errors.Is(err, errWatchAnew))
}

// unavailable reports whether err says JetStream cannot answer for now:
// a server restarting or electing a leader answers so, and nats.go's own
// ordered consumer retries these. The roster's watch goes through nats.go's
// older API, the member's other requests through package jetstream.
func unavailable(err error) bool {
	code := nats.ErrorCode(0)
	var old *nats.APIError
	var api *jetstream.APIError
	switch {
	case errors.As(err, &old):
		code = old.ErrorCode
	case errors.As(err, &api):
		code = nats.ErrorCode(api.ErrorCode)
	}
	switch code {
	case nats.JSErrCodeJetStreamNotEnabled, nats.JSErrCodeJetStreamNotAvailable, nats.JSErrCodeInsufficientResourcesErr:
		return true
	}
	return false
}

// agree checks that every live member uses a partition count this group
// has had on this stream: the stream's count, one this group has
// partition durables of, or one the stream holds events under (a member
// that has not read a change yet, or has read one this member has not).
// Another count is another group's: two groups share the name, or a
// member is not set up for this stream. A second group whose count
// happens to be one of those is not told apart (its members look like
// this group's). What it logs, it logs once in a join.
func (g *Member) agree(ctx context.Context, logged *joinLog) error {
	cfg := &g.cfg
	members, err := g.members(ctx)
	if err != nil {
		return err
	}
	counts := groupCounts{g: g} // read only when a member disagrees
	for _, m := range members {
		if m.id == cfg.Member && !logged.sameID {
			logged.sameID = true
			// Most likely this member's previous process, crashed within
			// the TTL. Were it alive, the pins still keep each partition
			// with one of the two.
			g.log.Warn("a member with this id is still registered: taking its place (give each process its own Group.Member)")
		}
		if m.partitions == cfg.Partitions {
			continue
		}
		ours, err := counts.had(ctx, m.partitions)
		if err != nil {
			return err
		}
		if ours {
			if !logged.others[m] {
				logged.others[m] = true
				g.log.Info("a member still uses another partition count of this group: it moves on at its next step",
					zap.String("other", m.id), zap.Int("its_partitions", m.partitions), zap.Int("partitions", cfg.Partitions))
			}
			continue
		}
		return fmt.Errorf("%w: member %s of group %s runs with %d partitions, this one with Group.Partitions %d, and stream %s has neither partition durables of group %s nor events for %d: two groups cannot share the name %s; give one another Name, or make them agree with the stream",
			ErrMismatch, m.id, cfg.Name, m.partitions, cfg.Partitions, cfg.Stream, cfg.Name, m.partitions, cfg.Name)
	}
	return nil
}

// joinLog is what agree has logged in one join.
type joinLog struct {
	sameID bool                // a member with this member's id
	others map[memberInfo]bool // members on another count of this group
}

// groupCounts tells which partition counts the group has had on its
// stream, for one agree: it reads the stream and the group's durables at
// the first question, and looks for a count's events at most once.
type groupCounts struct {
	g        *Member
	firstSeq uint64       // the stream's, when read
	known    map[int]bool // the stream's count and its durables', once read
}

// had reports whether the stream has, or had, partitions as its count:
// its count now, the count of partition durables of the group, or a count
// it holds events under. The last one covers a member whose step is later
// than the group's drain and removal of that count's durables.
func (c *groupCounts) had(ctx context.Context, partitions int) (bool, error) {
	g := c.g
	if c.known == nil {
		info, err := g.strm.Info(ctx)
		if err != nil {
			return false, fmt.Errorf("stream %s info: %w", g.cfg.Stream, err)
		}
		_, current, err := StreamPartitions(info.Config)
		if err != nil {
			return false, err
		}
		gens, err := g.generations(ctx)
		if err != nil {
			return false, err
		}
		c.firstSeq = max(info.State.FirstSeq, 1)
		c.known = map[int]bool{current: true}
		for n := range gens {
			c.known[n] = true
		}
	}
	if had, ok := c.known[partitions]; ok {
		return had, nil
	}
	if partitions < 1 || partitions > contract.MaxPartitions {
		return false, nil // not a count (a heartbeat of another kind)
	}
	seq, err := g.firstEventOf(ctx, partitions, c.firstSeq)
	if err != nil {
		return false, fmt.Errorf("look for %d-partition events in stream %s: %w", partitions, g.cfg.Stream, err)
	}
	c.known[partitions] = seq != 0
	return c.known[partitions], nil
}

func (g *Member) heartbeat(ctx context.Context) error {
	// The stream's count, not the configured one: after a partition-count
	// change, members started with the new count must not be refused.
	value := []byte(strconv.FormatInt(g.beatCount.Load(), 10))
	sent := time.Now()
	rev, err := g.bucket().Put(ctx, g.cfg.Member, value)
	if err != nil && ctx.Err() == nil && !timedOut(err) {
		// The bucket may be gone (a NATS restart lost a memory bucket, or
		// an operator deleted it): open it again, creating it, and rejoin.
		// Not on a timeout, which says nothing of the bucket: reopening
		// restarts every watch of it, and on a starved server that added
		// a consumer's creation to every late heartbeat.
		if oerr := g.openBucket(ctx); oerr == nil {
			rev, err = g.bucket().Put(ctx, g.cfg.Member, value)
		}
	}
	if err != nil {
		err = fmt.Errorf("heartbeat in group bucket: %w", err)
		g.beatErr.Store(&err)
		return err
	}
	g.beatErr.Store(nil)
	now := time.Now()
	g.lastBeat.Store(now.UnixNano())
	// Read after the put: an opening up to here restarts the watch anyway.
	why := g.roster.ownHeard(beatStored{rev: rev, opens: g.bucketOpens(), reconnects: g.connReconnects(), sent: sent, at: now}, g.ttl)
	if why != nil {
		select {
		case g.restale <- why:
		default:
		}
	}
	return nil
}

// beat heartbeats every interval until ctx ends.
func (g *Member) beat(ctx context.Context, interval time.Duration) {
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			_ = g.heartbeat(ctx) // the coordinator loop reports beatErr
		}
	}
}

// durableConfig is partition p's durable consumer, from as its metaFrom.
// The host adds the consumer's identity (database, filter) to its
// metadata.
func (g *Member) durableConfig(partitions, p int, from uint64) jetstream.ConsumerConfig {
	gc := &g.cfg
	cfg := gc.Durable
	cfg.Durable = PartitionDurable(gc.Name, partitions, p)
	cfg.Description = fmt.Sprintf("outbox-relay consumer group %s, partition %d of %d", gc.Name, p, partitions)
	cfg.FilterSubjects = nil
	cfg.FilterSubject = contract.PartitionFilter(g.source, partitions, p)
	cfg.PriorityPolicy = jetstream.PriorityPolicyPinned
	cfg.PriorityGroups = []string{PriorityGroup(gc.Name)}
	cfg.PinnedTTL = gc.PinnedTTL
	// The whole of MaxAckPending, so that one busy partition may use all
	// of it: the host's feeds share it across the partitions the member
	// owns (consumer/budget.go), which bounds the member.
	cfg.MaxAckPending = gc.MaxAckPending
	cfg.Metadata = map[string]string{
		metaGroup: gc.Name, metaPartitions: strconv.Itoa(partitions), metaPartition: strconv.Itoa(p),
		metaFrom: strconv.FormatUint(from, 10),
	}
	return cfg
}

// ensureGeneration creates the durables of a partition count that are
// missing, from being the stream's last sequence in the stream info that
// showed the count, after checking that existing ones (and ones another
// member creates at the same moment) are this group's (same database and
// filter); with update it also brings existing ones to this member's
// settings, but for the from they were created with.
func (g *Member) ensureGeneration(ctx context.Context, partitions int, from uint64, update bool) error {
	for p := range partitions {
		cfg := g.durableConfig(partitions, p, from)
		if update {
			cons, err := g.strm.Consumer(ctx, cfg.Durable)
			switch {
			case err == nil:
				if have, ok := cons.CachedInfo().Config.Metadata[metaFrom]; ok {
					cfg.Metadata[metaFrom] = have
				}
			case !errors.Is(err, jetstream.ErrConsumerNotFound):
				// Updating without its from would replace it by a later one.
				return fmt.Errorf("partition durable %s on stream %s: %w", cfg.Durable, g.cfg.Stream, err)
			}
		}
		if _, err := EnsureDurable(ctx, g.host, cfg, update); err != nil {
			return fmt.Errorf("partition durable %s on stream %s: %w", cfg.Durable, g.cfg.Stream, err)
		}
	}
	return nil
}

// generation is the partition durables of one partition count.
type generation struct {
	partitions int
	created    time.Time
	drained    bool
	durables   map[int]*jetstream.ConsumerInfo
	// from is the least metaFrom of the durables (fromKnown: every one
	// has it, as durables created by earlier versions do not).
	from      uint64
	fromKnown bool
	fromMax   uint64 // the greatest metaFrom of the durables
	// until is the last stream sequence of the generation that may be
	// consumed now: everything while it is the current count; while it
	// drains as an older one, what was stored before the newer counts
	// began (fence).
	until uint64
}

// coordinate is the member loop: heartbeat, read the stream's partition
// count and the group's durables, assign, start and hand off partitions.
func (g *Member) coordinate(ctx, pullCtx context.Context) error {
	cfg := &g.cfg
	beat := max(g.ttl/3, 100*time.Millisecond)
	bctx, stopBeat := context.WithCancel(ctx)
	var beating sync.WaitGroup
	beating.Go(func() { g.beat(bctx, beat) })
	defer beating.Wait()
	defer stopBeat()
	// Before its first assignment a new member waits one heartbeat, so that
	// members started together (a deployment's replicas) see each other at
	// once, instead of the first taking every partition and handing most
	// of them back: a busy partition's hand-off can wait out AckWait.
	select {
	case <-ctx.Done():
		return nil
	case <-time.After(beat):
	}
	tick := time.NewTicker(beat)
	defer tick.Stop()
	var failing observe.LoopHealth
	for {
		err := g.step(ctx, pullCtx)
		if ctx.Err() != nil {
			return nil
		}
		failing.Report(g.log, "consumer group step", err)
		var expired <-chan time.Time // a member runs out of TTL: reassign then
		if at := g.roster.nextExpiry(time.Now()); !at.IsZero() {
			expired = time.After(time.Until(at) + time.Millisecond)
		}
		select {
		case <-ctx.Done():
			return nil
		case err := <-g.errs:
			return fmt.Errorf("consume group %s from stream %s: %w", cfg.Name, cfg.Stream, err)
		case <-g.roster.changed: // a member joined or left: reassign now
		case <-expired:
		case <-tick.C:
		}
	}
}

func (g *Member) step(ctx, pullCtx context.Context) error {
	cfg := &g.cfg
	g.reap()
	info, err := g.strm.Info(ctx)
	if err != nil {
		return fmt.Errorf("stream %s info: %w", cfg.Stream, err)
	}
	_, current, err := StreamPartitions(info.Config)
	if err != nil {
		return err
	}
	// First of all, before any request: what a partition of another count
	// stored after this read is of a count gone back to (fence).
	for _, pt := range g.parts {
		if pt.partitions != current {
			pt.bound(info.State.LastSeq)
		}
	}
	if current != g.current {
		g.log.Info("the stream's partition count changed: the new partitions are consumed once the old ones are drained",
			zap.Int("from", g.current), zap.Int("to", current))
		g.current = current
		g.beatCount.Store(int64(current))
		g.straysDue = time.Time{}
	}
	var herr error
	if e := g.beatErr.Load(); e != nil {
		herr = *e
	}
	if herr != nil && time.Since(time.Unix(0, g.lastBeat.Load())) > g.ttl {
		// The others no longer count this member: give everything up.
		g.assign(pullCtx, nil, nil)
	}
	gens, active, err := g.activeGeneration(ctx, current, info.State.LastSeq)
	if errors.Is(err, errCountChanged) {
		return nil // nothing assigned: the next step reads the new count
	}
	if errors.Is(err, ErrMismatch) {
		g.assign(pullCtx, nil, nil)
		g.observe(gens, 0)
		return err
	}
	if err != nil {
		return err
	}
	members, err := g.members(ctx)
	if err != nil {
		// Without a roster nothing is reassigned, but the partitions'
		// gauges go on: an ownerless partition must show.
		g.observe(gens, active)
		return errors.Join(err, herr)
	}
	var ids []string
	for _, m := range members {
		ids = append(ids, m.id)
	}
	g.met.members.Set(float64(len(ids)))
	if herr == nil || time.Since(time.Unix(0, g.lastBeat.Load())) <= g.ttl {
		g.assign(pullCtx, ids, gens[active])
	}
	g.observe(gens, active)
	return herr
}

// activeGeneration lists the group's generations of partition durables,
// creating the current one's missing durables and removing drained older
// ones, and returns the partition count to consume: the oldest generation
// not drained yet, else the current one. lastSeq is the stream's last
// sequence in the stream info that showed current.
func (g *Member) activeGeneration(ctx context.Context, current int, lastSeq uint64) (map[int]*generation, int, error) {
	gens, err := g.generations(ctx)
	if err != nil {
		return nil, 0, err
	}
	if _, ok := gens[current]; !ok || len(gens[current].durables) < current {
		// The partition count changed: create the new generation; it is
		// consumed once every older one is drained.
		from, err := g.generationFrom(ctx, current, lastSeq)
		if err != nil {
			return nil, 0, err
		}
		if err := g.ensureGeneration(ctx, current, from, false); err != nil {
			return nil, 0, err
		}
		if gens, err = g.generations(ctx); err != nil {
			return nil, 0, err
		}
	}
	if time.Now().After(g.straysDue) {
		if err := g.strays(ctx, gens, current); err != nil {
			return gens, 0, err // checked again at the next step
		}
		g.straysDue = time.Now().Add(straysInterval)
	}
	var older []*generation
	for n, gen := range gens {
		if n != current {
			older = append(older, gen)
		}
	}
	sort.Slice(older, func(i, j int) bool { return older[i].created.Before(older[j].created) })
	for _, gen := range older {
		if cur := gens[current]; cur != nil && cur.created.Before(gen.created) && !gen.drained && !g.missingGone(ctx, gen) {
			// The count went back (4 → 8 → 4) before the generation in
			// between drained: the current durables hold events from
			// before it and after it, so neither can go first in order.
			g.reportDraining(gen)
			return gens, 0, fmt.Errorf("%w: the stream's partition count went back to %d while the %d-partition durables of group %s still hold events: consuming either generation now would apply some aggregates' events out of order, so nothing is consumed; set nats.partitions to %d again and run `outbox-relay setup`, and change the count only once the %d-partition durables are gone (docs/consumer.md \"Changing the number of partitions\")",
				ErrMismatch, current, gen.partitions, g.cfg.Name, gen.partitions, gen.partitions)
		}
		if !gen.drained && len(gen.durables) < gen.partitions {
			// A removal that stopped part-way (an API timeout, a member
			// stopped mid-way) leaves an incomplete generation: it is
			// drained when the durables that are left are and the missing
			// ones are confirmed gone, and its removal is taken up again.
			gen.drained = g.missingGone(ctx, gen)
		}
		if gen.drained {
			// Nothing pending or unacknowledged: no member has anything of
			// it in flight. Members still pulling it see the durables go.
			if err := g.removeGeneration(ctx, gen); err != nil {
				// Drained is drained: the group moves on, and the next
				// step deletes what is left.
				g.log.Warn("remove drained partition generation; retried at the next step", zap.Int("partitions", gen.partitions), zap.Error(err))
			}
			delete(gens, gen.partitions)
			continue
		}
		g.reportDraining(gen)
		if err := g.fence(ctx, gens, gen, lastSeq); err != nil {
			return gens, 0, err
		}
		return gens, gen.partitions, nil
	}
	if !g.drainSince.IsZero() {
		g.drainSince = time.Time{}
		g.met.draining.Reset()
	}
	if cur := gens[current]; cur != nil {
		cur.until = math.MaxUint64
	}
	return gens, current, nil
}

// missingGone reports whether the durables present of gen have nothing
// pending or unacknowledged and the missing ones do not exist.
func (g *Member) missingGone(ctx context.Context, gen *generation) bool {
	for p := range gen.partitions {
		ci, ok := gen.durables[p]
		if ok {
			if ci.NumPending > 0 || ci.NumAckPending > 0 {
				return false
			}
			continue
		}
		_, err := g.strm.Consumer(ctx, PartitionDurable(g.cfg.Name, gen.partitions, p))
		if !errors.Is(err, jetstream.ErrConsumerNotFound) {
			return false
		}
	}
	return true
}

// reportDraining names, at most once a minute, the partitions of an older
// generation that keep the group from moving to the current one: a
// message retried without limit there blocks every new partition.
func (g *Member) reportDraining(gen *generation) {
	g.markDraining(gen.partitions)
	if time.Since(g.drainLogged) < time.Minute {
		return
	}
	g.drainLogged = time.Now()
	var busy []int
	for p, ci := range gen.durables {
		if ci.NumPending > 0 || ci.NumAckPending > 0 {
			busy = append(busy, p)
		}
	}
	slices.Sort(busy)
	g.log.Info("waiting for an older partition generation to drain before consuming the current one",
		zap.Int("partitions", gen.partitions), zap.Ints("undrained", busy), zap.Duration("since_created", time.Since(gen.created)))
}

// markDraining sets the draining gauge of a partition count that keeps
// the group from consuming the current one.
func (g *Member) markDraining(partitions int) {
	if g.drainSince.IsZero() {
		g.drainSince = time.Now()
	}
	g.met.draining.WithLabelValues(g.met.name, strconv.Itoa(partitions)).Set(time.Since(g.drainSince).Seconds())
}

// generations lists the group's partition durables by partition count.
func (g *Member) generations(ctx context.Context) (map[int]*generation, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	l := g.strm.ListConsumers(ctx)
	gens := map[int]*generation{}
	for ci := range l.Info() {
		n, p, err := g.cfg.durableGeneration(ci)
		if err != nil {
			continue
		}
		gen := gens[n]
		if gen == nil {
			gen = &generation{partitions: n, created: ci.Created, drained: true, durables: map[int]*jetstream.ConsumerInfo{},
				from: math.MaxUint64, fromKnown: true}
			gens[n] = gen
		}
		if from, err := strconv.ParseUint(ci.Config.Metadata[metaFrom], 10, 64); err == nil {
			gen.from = min(gen.from, from)
			gen.fromMax = max(gen.fromMax, from)
		} else {
			gen.fromKnown = false
		}
		if ci.Created.Before(gen.created) {
			gen.created = ci.Created
		}
		gen.durables[p] = ci
		if ci.NumPending > 0 || ci.NumAckPending > 0 {
			gen.drained = false
		}
	}
	if err := l.Err(); err != nil {
		return nil, fmt.Errorf("list consumers of stream %s: %w", g.cfg.Stream, err)
	}
	for _, gen := range gens {
		if len(gen.durables) < gen.partitions {
			gen.drained = false // an incomplete listing proves nothing
		}
	}
	return gens, nil
}

// removeGeneration deletes a drained older generation. No message can
// reach its durables any more: the stream's transform writes the new
// count into every subject since the change. Each delete is tried (one
// that fails does not stop the others), and a generation left incomplete
// is taken up again at the next step (activeGeneration).
func (g *Member) removeGeneration(ctx context.Context, gen *generation) error {
	var errs []error
	for p := range gen.durables {
		name := PartitionDurable(g.cfg.Name, gen.partitions, p)
		if err := DeleteDurable(ctx, g.strm, name); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
			errs = append(errs, fmt.Errorf("delete drained partition durable %s: %w", name, err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	g.log.Info("older partition generation drained and removed", zap.Int("partitions", gen.partitions))
	return nil
}

// DeleteDurable deletes a partition durable; tests make it fail.
var DeleteDurable = func(ctx context.Context, strm jetstream.Stream, name string) error {
	return strm.DeleteConsumer(ctx, name)
}

// assignment returns the partitions of a count that member owns among
// members (sorted): partition p goes to members[p mod len(members)].
func assignment(members []string, member string, partitions int) []int {
	i := slices.Index(members, member)
	if i < 0 {
		return nil
	}
	var out []int
	for p := i; p < partitions; p += len(members) {
		out = append(out, p)
	}
	return out
}

// assign starts the partitions of gen this member now owns and hands off
// the others.
func (g *Member) assign(pullCtx context.Context, members []string, gen *generation) {
	g.started = true
	var mine []int
	want := map[string]bool{}
	if gen != nil {
		mine = assignment(members, g.cfg.Member, gen.partitions)
		for _, p := range mine {
			want[PartitionDurable(g.cfg.Name, gen.partitions, p)] = true
		}
	}
	if !slices.Equal(mine, g.assigned) {
		if g.assigned != nil || mine != nil {
			g.met.rebalances.Inc()
		}
		g.log.Info("partition assignment", zap.Ints("partitions", mine), zap.Strings("members", members))
		g.assigned = mine
	}
	for name, pt := range g.parts {
		if !want[name] {
			pt.release()
		}
	}
	for _, p := range mine {
		name := PartitionDurable(g.cfg.Name, gen.partitions, p)
		if pt, running := g.parts[name]; running {
			pt.setUntil(gen.until)
			continue // running, or still handing off: started again after
		}
		cons, err := g.strm.Consumer(pullCtx, name)
		if err != nil {
			g.log.Warn("look up partition durable", zap.String("durable", name), zap.Error(err))
			continue
		}
		pt := newPartition(g, gen.partitions, p, cons, gen.until)
		g.parts[name] = pt
		g.wg.Add(1)
		go func() {
			defer g.wg.Done()
			if err := pt.run(pullCtx); err != nil && pullCtx.Err() == nil {
				select {
				case g.errs <- err:
				default:
				}
			}
		}()
	}
	owned := 0
	for _, pt := range g.parts {
		if !isClosed(pt.handoff) {
			owned++
		}
	}
	g.met.owned.Set(float64(owned))
}

// reap forgets partitions whose goroutine has returned.
func (g *Member) reap() {
	for name, pt := range g.parts {
		if isClosed(pt.done) {
			delete(g.parts, name)
		}
	}
}

// shutdown leaves the group and hands off every partition (bounded by
// DrainTimeout). It leaves first, so that the others take the partitions
// over at once: their reset to the ack floor keeps the order while this
// member's workers settle what they hold (the dedup row makes the overlap
// duplicates, not reorderings).
func (g *Member) shutdown() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := g.bucket().Delete(ctx, g.cfg.Member); err != nil {
		g.log.Debug("leave group: the member entry expires by itself", zap.Error(err))
	}
	for _, pt := range g.parts {
		pt.release()
	}
	done := make(chan struct{})
	go func() { g.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(g.cfg.DrainTimeout + 5*time.Second):
		g.log.Warn("partitions still handing off at shutdown")
	}
}

// Gone reports which stream sequences need no further processing by the
// group: a sequence is gone when it left the stream or is at or below its
// own partition durable's ack floor. One whose state cannot be learnt is
// not gone.
func (g *Member) Gone(ctx context.Context, seqs []uint64) map[uint64]bool {
	ctx, cancel := context.WithTimeout(ctx, min(g.cfg.AckWait/3, 5*time.Second))
	defer cancel()
	gone := make(map[uint64]bool, len(seqs))
	for _, seq := range seqs {
		raw, err := g.strm.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			gone[seq] = true
			continue
		}
		if err != nil {
			continue
		}
		n, p, ok := contract.SubjectPartition(g.source, raw.Subject)
		if !ok {
			continue
		}
		ci, err := g.strm.Consumer(ctx, PartitionDurable(g.cfg.Name, n, p))
		if errors.Is(err, jetstream.ErrConsumerNotFound) {
			gone[seq] = true // its generation was drained and removed
			continue
		}
		if err != nil {
			continue
		}
		gone[seq] = seq <= ci.CachedInfo().AckFloor.Stream
	}
	return gone
}
