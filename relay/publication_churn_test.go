package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/opstest"
	"github.com/outbox-relay/outbox-relay/internal/relaytest"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/relay"
)

// Adversarial review of issue 25: the publication dropped and created
// again while the relay streams.
func TestRelayPublicationRecreated(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	f := newFixture(t, "")
	s := startStreaming(t, ctx, f)
	rl, pub, exec, w, all := s.rl, s.pub, s.exec, s.w, s.all
	exec(`DROP PUBLICATION ` + pub)
	all = append(all, w.Write(ctx, 50, 5)...)
	exec(`CREATE PUBLICATION ` + pub + ` FOR TABLE outbox WITH (publish = 'insert')`)
	// The gap filled (from the table) before the last rows are written:
	// only the slot can deliver those, through the stretch it cannot
	// decode.
	f.WaitCount(ctx, f.Stream, 100, 30*time.Second)
	if !testenv.WaitFor(30*time.Second, func() bool { return rl.PublicationProblem() == nil }) {
		t.Fatalf("publication still reported wrong: %v", rl.PublicationProblem())
	}
	all = append(all, w.Write(ctx, 50, 5)...)
	testenv.WaitFor(60*time.Second, func() bool { return relaytest.StreamCount(ctx, f.JS, f.Stream) >= uint64(len(all)) })
	if rep := relaytest.Check(all, f.Read(ctx, f.Stream)); !rep.OK() {
		t.Fatalf("stream check after the publication was recreated: %s", rep)
	}
}

// Adversarial review of issue 25: the publication broken and fixed three
// ways, repeatedly, while a concurrent load runs, in both publishing
// modes: nothing missing, nothing out of order.
func TestRelayPublicationChurnUnderLoad(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"auto", "off"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			f := newFixture(t, "")
			f.Cfg.BatchPublish = mode
			f.Cfg.PublicationCheck = 200 * time.Millisecond
			f.Setup(ctx)
			rl, _ := f.Start(ctx)
			if _, err := f.DB.Pool.Exec(ctx, "CREATE TABLE churn_other (id int)"); err != nil {
				t.Fatal(err)
			}
			pub := `"` + f.Cfg.Replication.Publication + `"`
			// Streaming first: a wrong publication at start stops the relay.
			first := f.NewWriter(1).Write(ctx, 1, 1)
			f.WaitCount(ctx, f.Stream, 1, 30*time.Second)
			wait := relaytest.WriteAsync(ctx, t, f.DB.Pool, relaytest.Load{Events: 3000, Aggregates: 40, Writers: 4, BigTx: 20, Pause: 60 * time.Millisecond})
			pairs := [][2]string{
				{`ALTER PUBLICATION ` + pub + ` DROP TABLE outbox`, `ALTER PUBLICATION ` + pub + ` ADD TABLE outbox`},
				{`ALTER PUBLICATION ` + pub + ` SET (publish = 'update')`, `ALTER PUBLICATION ` + pub + ` SET (publish = 'insert')`},
				{`ALTER PUBLICATION ` + pub + ` SET TABLE churn_other`, `ALTER PUBLICATION ` + pub + ` SET TABLE outbox`},
			}
			for round := 0; round < 2; round++ {
				for _, p := range pairs {
					for i, sql := range p {
						if _, err := f.DB.Pool.Exec(ctx, sql); err != nil {
							t.Fatalf("%s: %v", sql, err)
						}
						if i == 0 {
							testenv.WaitFor(5*time.Second, func() bool { return rl.PublicationProblem() != nil })
						} else {
							testenv.WaitFor(20*time.Second, func() bool { return rl.PublicationProblem() == nil })
						}
					}
				}
			}
			evs := wait()
			relaytest.StoredPayloads(ctx, t, f.DB.Pool, "outbox", evs)
			all := append(first, evs...)
			testenv.WaitFor(90*time.Second, func() bool { return relaytest.StreamCount(ctx, f.JS, f.Stream) >= uint64(len(all)) })
			if rep := relaytest.Check(all, f.Read(ctx, f.Stream)); !rep.OK() {
				t.Fatalf("stream check after publication churn under load: %s", rep)
			}
		})
	}
}

// streamingScene is a relay streaming with a fast publication check and
// 50 events of five writers relayed: where the publication tests change
// things under it.
type streamingScene struct {
	rl   *relay.Relay
	pub  string           // the publication's name, quoted
	exec func(sql string) // on the test's database
	w    *opstest.Writer
	all  []relaytest.Event // written so far
}

func startStreaming(t *testing.T, ctx context.Context, f *fixture) streamingScene {
	t.Helper()
	f.Cfg.PublicationCheck = 200 * time.Millisecond
	f.Setup(ctx)
	rl, _ := f.Start(ctx)
	s := streamingScene{rl: rl, pub: `"` + f.Cfg.Replication.Publication + `"`, exec: sqlExec(t, ctx, f.DB.Pool), w: f.NewWriter(5)}
	s.all = s.w.Write(ctx, 50, 5)
	f.WaitCount(ctx, f.Stream, 50, 30*time.Second)
	return s
}
