package consumer

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestLostPullRequestDoesNotStallTheFeed: one pull request of the feed's
// never reaches the server. nats.go counts the messages it asked for as
// on their way and asks for more only once fewer than half are, so with
// the server owing nothing it neither asks again nor hears a heartbeat
// (the server sends those only for a request it holds), until its missed
// heartbeat check gives up on the pull: with nats.go's default of half the
// 30 s expiry, 30 s without a delivery. The same state came about on a
// loaded box without any loss on the wire (bench/README.md, the plain
// durable's 30 s stall): the consumer must be going again within a few
// heartbeats, not after the expiry.
func TestLostPullRequestDoesNotStallTheFeed(t *testing.T) {
	env := testenv.Get(t)
	const name = "lostpull"
	// The second pull request for the durable is dropped: the first asked
	// for 500, the second would have been sent once 251 were received.
	var seen atomic.Int32
	filter := startNATSFilter(t, strings.TrimPrefix(env.NATS.URL, "nats://"), func(subject string) bool {
		return strings.HasPrefix(subject, "$JS.API.CONSUMER.MSG.NEXT.") && strings.HasSuffix(subject, "."+name) &&
			seen.Add(1) == 2
	})
	f := newFixtureOn(t, env.NewDatabase(t), "nats://"+filter)

	const events = 1200
	for i := range events {
		f.publish(event{ID: uuidN(i + 1), AggID: fmt.Sprintf("agg-%d", i%40), Version: int64(i/40 + 1)})
	}
	cfg := f.baseConfig(name)
	cfg.AckWait = time.Minute // no redelivery timer helps here
	c := f.start(cfg, newRecorder(name))
	// Generous beside six CPU hogs, well short of the 30 s nats.go would
	// take by itself.
	f.waitFor("every event applied", 15*time.Second, func() bool {
		return queryInt(t, f.pool, `SELECT count(DISTINCT event_id) FROM applied`) >= events
	})
	if n := seen.Load(); n < 3 {
		t.Fatalf("the filter saw %d pull requests; the test needs the second one dropped and a later one sent", n)
	}
	if n := metricValue(t, c.met.silences); n < 1 {
		t.Errorf("outbox_consumer_pull_silences_total = %v after a silent pull, want ≥ 1", n)
	}
}

// TestStalledLinkEndsThePullInsteadOfPilingUpRequests: the consumer's link
// to NATS stops carrying bytes for 12 s (the TCP connection stays up)
// while events are published on another connection. Pulling on after each
// missed-heartbeat check would make nats.go ask afresh every few seconds
// beside the requests the server still holds, and on heal the server
// would deliver them all into nats.go's buffer sized for one request:
// slow-consumer drops and a gap (with 1 s heartbeats and pulling on: 1–2
// drops and 1 gap reset in every run). The feed ends such a pull instead
// and resumes from the ack floor once the server answers.
func TestStalledLinkEndsThePullInsteadOfPilingUpRequests(t *testing.T) {
	env := testenv.Get(t)
	f := newFixture(t)
	proxy, err := testenv.StartProxy(strings.TrimPrefix(env.NATS.URL, "nats://"))
	testenv.Must(t, err, "proxy")
	t.Cleanup(proxy.Close)
	var slow atomic.Int64
	nc, err := nats.Connect("nats://"+proxy.Addr, nats.MaxReconnects(-1),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			if errors.Is(err, nats.ErrSlowConsumer) {
				slow.Add(1)
			}
		}))
	testenv.Must(t, err, "connect through the proxy")
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	testenv.Must(t, err, "jetstream")

	const name = "stalled"
	cfg := f.baseConfig(name)
	cfg.AckWait = 30 * time.Second
	c := f.startOn(js, cfg, newRecorder(name))
	f.waitFor("the pull held by the server", 30*time.Second, func() bool {
		info, ok := f.consumerInfo(name)
		return ok && info.NumWaiting >= 1
	})
	proxy.Stall(testenv.Both)
	healAt := time.Now().Add(12 * time.Second)
	const events = 4000
	for i := range events {
		e := event{ID: uuidN(i + 1), AggID: fmt.Sprintf("agg-%d", i%100), Version: int64(i/100 + 1)}
		if _, err := f.js.PublishMsgAsync(e.msg(f.stream)); err != nil {
			t.Fatal(err)
		}
	}
	<-f.js.PublishAsyncComplete()
	f.waitFor("two missed-heartbeat checks", time.Until(healAt)+time.Minute, func() bool {
		return metricValue(t, c.met.silences) >= 1 && !time.Now().Before(healAt)
	})
	proxy.Heal()
	f.waitFor("every event applied", 3*time.Minute, func() bool {
		return queryInt(t, f.pool, `SELECT count(DISTINCT event_id) FROM applied`) >= events
	})
	f.waitSettled(name, 2*time.Minute)
	twice := queryInt(t, f.pool, `SELECT count(*) FROM (SELECT event_id FROM applied GROUP BY event_id HAVING count(*) > 1) d`)
	disorder := queryInt(t, f.pool, `SELECT count(*) FROM (
		SELECT version, row_number() OVER (PARTITION BY aggregate_id ORDER BY n) AS pos FROM applied) o WHERE version <> pos`)
	res := resumesByReason(t, f.reg)
	t.Logf("silences %.0f, resumes %v, slow-consumer reports %d", metricValue(t, c.met.silences), res, slow.Load())
	if twice != 0 || disorder != 0 {
		t.Errorf("applied twice %d, out of version order %d", twice, disorder)
	}
	if slow.Load() != 0 || res[resumeGap] != 0 {
		t.Errorf("the stalled link made %d slow-consumer drops and %.0f gap resets", slow.Load(), res[resumeGap])
	}
}

// startNATSFilter forwards NATS client connections to target and drops
// every client publish (PUB or HPUB) whose subject drop selects; the rest
// of both directions passes unchanged. It returns its host:port.
func startNATSFilter(t *testing.T, target string, drop func(subject string) bool) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	testenv.Must(t, err, "filter listen")
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			client, err := ln.Accept()
			if err != nil {
				return
			}
			server, err := net.Dial("tcp", target)
			if err != nil {
				client.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, client, server)
			mu.Unlock()
			wg.Add(2)
			go func() {
				defer wg.Done()
				_, _ = io.Copy(client, server)
				client.Close()
			}()
			go func() {
				defer wg.Done()
				_ = filterPublishes(client, server, drop)
				server.Close()
			}()
		}
	}()
	return ln.Addr().String()
}

// filterPublishes copies the client's protocol lines to the server, but
// for the publishes drop selects, whose line and payload it skips.
func filterPublishes(client io.Reader, server io.Writer, drop func(subject string) bool) error {
	r := bufio.NewReader(client)
	for {
		line, err := r.ReadBytes('\n')
		if err != nil {
			return err
		}
		var payload []byte
		if f := bytes.Fields(line); len(f) >= 3 && (string(f[0]) == "PUB" || string(f[0]) == "HPUB") {
			size, err := strconv.Atoi(string(f[len(f)-1]))
			if err != nil {
				return fmt.Errorf("publish line %q: %w", line, err)
			}
			payload = make([]byte, size+2) // and its CRLF
			if _, err := io.ReadFull(r, payload); err != nil {
				return err
			}
			if drop(string(f[1])) {
				continue
			}
		}
		if _, err := server.Write(append(line, payload...)); err != nil {
			return err
		}
	}
}
