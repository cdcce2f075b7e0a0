package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/outbox-relay/outbox-relay/consumer"
	"github.com/outbox-relay/outbox-relay/internal/reward"
)

// The group stage: the reward service as a consumer group of two members
// over the partitioned stream (nats.partitions), as two copies of
// cmd/reward-consumer --group-partitions run it. One member crashes; the
// other takes its partitions over and every point is still credited once.
const (
	demoPartitions = 4
	groupName      = "reward-group"
	groupPhase1    = 8 // registrations confirmed while both members run
	groupPhase2    = 6 // and after one of them crashed
)

// groupCredit is a committed credit and the member that applied it.
type groupCredit struct {
	credit
	member string
}

// groupMember is one in-process member with its own connections, so that
// a crash can be simulated by closing them at once.
type groupMember struct {
	name string
	nc   *nats.Conn
	pool *pgxpool.Pool
	reg  *prometheus.Registry // the member's metrics: the partitions it owns
	stop context.CancelFunc
	done chan error
}

func (d *demo) groupRewards(ctx context.Context) error {
	d.out.step("reward service as a consumer group: %d partitions (nats.partitions), two members, one crashes", demoPartitions)
	url, pool, err := d.createDatabase(ctx, "rewards_group", "consumer.sql", "reward.sql")
	if err != nil {
		return err
	}
	q, err := confirmSQL(d.sqlDir)
	if err != nil {
		return err
	}
	// The watcher would print every event of this stage: keep it quiet.
	d.quietEvents.Store(true)
	defer d.quietEvents.Store(false)

	// The stream already holds the first stage's events: the group's
	// durable reads the stream from its start, as a new service joining an
	// existing stream does. Their registrations are mapped here too, so the
	// members credit them once and dead-letter nothing.
	evs, _ := d.arrivals.expectedEvents()
	history, err := seedRegistrations(ctx, pool, evs)
	if err != nil {
		return err
	}
	credits := make(chan groupCredit, len(history)+groupPhase1+groupPhase2+1)
	var members []*groupMember
	defer func() {
		for _, m := range members {
			m.stop()
			<-m.done
		}
	}()
	for _, name := range []string{"member-a", "member-b"} {
		m, err := d.startMember(ctx, url, name, credits)
		if err != nil {
			return err
		}
		members = append(members, m)
	}
	if !poll(ctx, d.opts.wait, func() bool { return d.groupMembers(ctx) == 2 }) {
		return errors.New("the two members did not join the group")
	}
	// Joined is a heartbeat; a member consumes once the assignment gave it
	// its partitions. Without this wait the first registrations could all
	// land on member-a's partitions while member-b is still starting, and
	// "share the load" would show nothing.
	share := demoPartitions / len(members)
	if !poll(ctx, d.opts.wait, func() bool {
		for _, m := range members {
			if metricSum(m.reg, "outbox_consumer_group_partitions_owned") != float64(share) {
				return false
			}
		}
		return true
	}) {
		return fmt.Errorf("the two members did not take %d partitions each", share)
	}
	d.out.detail("member-a and member-b joined group %s and own %d partitions each; partition p goes to the (p mod 2)-th live member, each partition pinned to one member by JetStream", groupName, share)

	players := map[string]string{}
	confirmN := func(n int) ([]confirmedEvent, error) {
		ids, err := insertRegistrations(ctx, d.appPool, n)
		if err != nil {
			return nil, err
		}
		var evs []confirmedEvent
		for _, id := range ids {
			players[id] = uuid.NewString()
			if _, err := pool.Exec(ctx, `INSERT INTO reward_account (player_id, points) VALUES ($1, 0)`, players[id]); err != nil {
				return nil, err
			}
			if _, err := pool.Exec(ctx, `INSERT INTO reward_registration (registration_id, player_id) VALUES ($1, $2)`, id, players[id]); err != nil {
				return nil, err
			}
			ev, ok, err := confirm(ctx, d.appPool, q, id, 1)
			if err != nil {
				return nil, err
			}
			if !ok {
				return nil, fmt.Errorf("confirm registration %s returned no row", id)
			}
			d.expect(ev)
			evs = append(evs, ev)
		}
		return evs, nil
	}
	// collect waits for n credits of this stage's registrations, or with
	// old for those of the first stage's (history).
	collect := func(n int, old bool) (map[string][]string, error) {
		by := map[string][]string{}
		timeout := time.NewTimer(d.opts.wait + 15*time.Second)
		defer timeout.Stop()
		for n > 0 {
			select {
			case c := <-credits:
				if _, hist := history[c.registration]; hist != old {
					continue
				}
				n--
				by[c.member] = append(by[c.member], short(c.registration))
			case <-ctx.Done():
				return nil, ctx.Err()
			case <-timeout.C:
				return nil, fmt.Errorf("%w: the group did not credit every registration in time", errMissingEvents)
			}
		}
		return by, nil
	}
	printBy := func(by map[string][]string) {
		names := make([]string, 0, len(by))
		for n := range by {
			names = append(names, n)
		}
		slices.Sort(names)
		for _, n := range names {
			d.out.detail("%s credited %d: %s", n, len(by[n]), strings.Join(by[n], " "))
		}
	}

	// The first stage's events come first in the stream: once they are
	// credited, the check at the end cannot race their application (a
	// member that crashes before applying them leaves them to the takeover).
	by, err := collect(len(history), true)
	if err != nil {
		return fmt.Errorf("the first stage's registrations: %w", err)
	}
	d.out.detail("the group reads the stream from its start: the %d registrations of the first stage are mapped in this service's database too, so the members credit them once and dead-letter nothing", len(history))
	printBy(by)

	if _, err := confirmN(groupPhase1); err != nil {
		return err
	}
	by, err = collect(groupPhase1, false)
	if err != nil {
		return err
	}
	d.out.detail("%d registrations confirmed while both members run: the members share the load", groupPhase1)
	printBy(by)

	// The crash: member-b's connections close at once, nothing is handed
	// off; its partitions stay pinned to it until PinnedTTL expires.
	b := members[1]
	b.nc.Close()
	b.pool.Close()
	b.stop()
	<-b.done
	members = members[:1]
	crashed := time.Now()
	d.out.detail("member-b crashed (its NATS connection and database pool closed at once, no hand-off)")
	if _, err := confirmN(groupPhase2); err != nil {
		return err
	}
	by, err = collect(groupPhase2, false)
	if err != nil {
		return err
	}
	d.out.detail("%d more registrations confirmed: member-a took member-b's partitions over without an operator, all credited %.1fs after the crash", groupPhase2, time.Since(crashed).Seconds())
	printBy(by)

	for reg, player := range history {
		players[reg] = player
	}
	for reg, player := range players {
		var points int64
		if err := pool.QueryRow(ctx, `SELECT points FROM reward_account WHERE player_id = $1`, player).Scan(&points); err != nil {
			return err
		}
		if points != rewardPoints {
			return fmt.Errorf("player %s (registration %s) has %d points, want %d: not credited exactly once", player, reg, points, rewardPoints)
		}
	}
	var dead int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM consumer_dead_letter`).Scan(&dead); err != nil {
		return err
	}
	if dead != 0 {
		return fmt.Errorf("the group dead-lettered %d events, want none (`outbox-relay dlq list`)", dead)
	}
	d.out.detail("all %d players of this stage and the first have exactly %d points, no dead letter: each registration credited once across the crash", len(players), rewardPoints)
	return nil
}

// seedRegistrations maps the events' registrations each to a new player
// with an empty reward account, and returns them (registration -> player).
func seedRegistrations(ctx context.Context, pool *pgxpool.Pool, evs []confirmedEvent) (map[string]string, error) {
	players := make(map[string]string, len(evs))
	for _, ev := range evs {
		players[ev.RegistrationID] = uuid.NewString()
		if _, err := pool.Exec(ctx, `INSERT INTO reward_account (player_id, points) VALUES ($1, 0)`, players[ev.RegistrationID]); err != nil {
			return nil, fmt.Errorf("open reward account: %w", err)
		}
		if _, err := pool.Exec(ctx, `INSERT INTO reward_registration (registration_id, player_id) VALUES ($1, $2)`, ev.RegistrationID, players[ev.RegistrationID]); err != nil {
			return nil, fmt.Errorf("map registration to player: %w", err)
		}
	}
	return players, nil
}

// groupMembers counts the live members in the group's bucket.
func (d *demo) groupMembers(ctx context.Context) int {
	kv, err := d.js.KeyValue(ctx, consumer.GroupBucket(groupName))
	if err != nil {
		return 0
	}
	keys, err := kv.Keys(ctx)
	if err != nil {
		return 0
	}
	return len(keys)
}

func (d *demo) startMember(ctx context.Context, url, name string, credits chan<- groupCredit) (*groupMember, error) {
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return nil, err
	}
	nc, err := nats.Connect(d.nats.URL, nats.Name(name))
	if err != nil {
		pool.Close()
		return nil, err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		pool.Close()
		return nil, err
	}
	reg := prometheus.NewRegistry()
	var mu sync.Mutex
	pending := map[string]credit{}
	h := reward.Handler{Ledger: rewardLedger, Points: rewardPoints, Applied: func(m *consumer.Message, registration, player uuid.UUID) {
		mu.Lock()
		pending[m.ID] = credit{registration: registration.String(), player: player.String()}
		mu.Unlock()
	}}
	after := func(m *consumer.Message) {
		mu.Lock()
		c, ok := pending[m.ID]
		delete(pending, m.ID)
		mu.Unlock()
		if ok {
			select {
			case credits <- groupCredit{credit: c, member: name}:
			default:
			}
		}
	}
	c, err := consumer.New(pool, js, consumer.Config{
		Name:       groupName,
		Stream:     d.cfg.NATS.Stream,
		Owner:      "rewards-team",
		Workers:    2,
		AckWait:    2 * time.Second,
		RetryMax:   500 * time.Millisecond,
		EventTypes: []string{rewardEvent},
		Group:      &consumer.GroupConfig{Partitions: demoPartitions, Member: name, MemberTTL: 2 * time.Second},
	}, &h, consumer.WithLogger(d.log.Named(name).WithOptions(zap.IncreaseLevel(zap.ErrorLevel))), consumer.WithRegisterer(reg), consumer.WithAfterCommit(after))
	if err != nil {
		nc.Close()
		pool.Close()
		return nil, err
	}
	mctx, stop := context.WithCancel(ctx)
	m := &groupMember{name: name, nc: nc, pool: pool, reg: reg, stop: stop, done: make(chan error, 1)}
	go func() {
		err := c.Run(mctx)
		nc.Close()
		pool.Close()
		m.done <- err
	}()
	return m, nil
}
