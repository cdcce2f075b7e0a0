package main

import (
	"encoding/xml"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func samplePhase() *loadPhase {
	p := &loadPhase{PGSettings: map[string]string{"fsync": "on"}, Drain: &loadPoint{BatchSize: 64, Relay: procCost{CPUPer1k: 0.01}, Consumer: procCost{CPUPer1k: 0.05}}}
	for _, rate := range []int{100, 2000} {
		for _, batch := range []int{1, 64} {
			p.Runs = append(p.Runs, loadPoint{Offered: rate, BatchSize: batch, Achieved: float64(rate),
				InsertToApplied: quantiles{P50: 2, P99: 6}, Relay: procCost{CPUPer1k: 0.03}, Consumer: procCost{CPUPer1k: 0.2},
				NATS: procCost{CPUPer1k: 0.1}, Postgres: procCost{CPUPer1k: 0.4}})
		}
		p.Floor = append(p.Floor, e2eFloor{Offered: rate, InsertToApplied: quantiles{P50: 1, P99: 2}})
	}
	return p
}

func TestJudgeLoad(t *testing.T) {
	ts := judgeLoad(&results{Load: samplePhase()})
	want := map[string]struct {
		v  float64
		ok bool
	}{
		"relay CPU/event at 2,000/s, consumer batch 64 ÷ its drain's":  {3, true},
		"insert→applied p99 at 2,000/s, consumer batch 64 ÷ floor p99": {3, false},
		"insert→applied p99 at 2,000/s, consumer batch 1 (ms)":         {6, false},
	}
	found := 0
	for _, tg := range ts {
		if w, ok := want[tg.Name]; ok {
			found++
			if d := tg.Value - w.v; d > 1e-9 || d < -1e-9 || tg.OK != w.ok {
				t.Errorf("%s: %v ok=%v, want %v ok=%v", tg.Name, tg.Value, tg.OK, w.v, w.ok)
			}
		}
	}
	if found != len(want) {
		t.Errorf("found %d of %d targets in %+v", found, len(want), ts)
	}
}

func TestLoadFilesAreWellFormed(t *testing.T) {
	base := filepath.Join(t.TempDir(), "2026-12-02T000000Z")
	r := &results{Date: time.Now().UTC().Format(time.RFC3339), Load: samplePhase()}
	if err := writeLoadFiles(base, r); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"-load-cost.svg", "-load-p99.svg"} {
		b, err := os.ReadFile(base + name)
		if err != nil {
			t.Fatal(err)
		}
		d := xml.NewDecoder(strings.NewReader(string(b)))
		lines := 0
		for {
			tok, err := d.Token()
			if err != nil {
				if err.Error() != "EOF" {
					t.Fatalf("%s: %v", name, err)
				}
				break
			}
			if se, ok := tok.(xml.StartElement); ok && se.Name.Local == "polyline" {
				lines++
			}
		}
		if lines < 3 {
			t.Errorf("%s: %d lines plotted", name, lines)
		}
	}
	md, err := os.ReadFile(base + "-load.md")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(md), "| drain (0 rows/tx) | 64 |") || !strings.Contains(string(md), "2026-12-02T000000Z-load-cost.svg") {
		t.Errorf("markdown:\n%s", md)
	}
}

func TestMessagesPerTx(t *testing.T) {
	for _, c := range []struct {
		name string
		pt   loadPoint
		want float64
	}{
		{"not reported", loadPoint{BatchSize: 64, Events: 1000}, 0},
		{"every message alone", loadPoint{BatchSize: 64, Events: 1000, ConsumerTx: 1000}, 1},
		{"half in batches of 4", loadPoint{BatchSize: 64, Events: 1000, ConsumerBatches: 125, ConsumerBatched: 500, ConsumerTx: 625}, 1000.0 / 625},
		{"all in batches of 10", loadPoint{BatchSize: 64, Events: 1000, ConsumerBatches: 100, ConsumerBatched: 1000, ConsumerTx: 100}, 10},
	} {
		if got := c.pt.messagesPerTx(); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
}

func TestSetBatches(t *testing.T) {
	m := &memberProc{progress: &memberProgress{}}
	pt := loadPoint{BatchSize: 64, Events: 1000}
	pt.setBatches(m) // exited without its report
	if pt.messagesPerTx() != 0 {
		t.Fatalf("unreported: %v messages/tx", pt.messagesPerTx())
	}
	m.progress.batches.Store(125)
	m.progress.batched.Store(500)
	m.progress.reported.Store(true)
	pt.setBatches(m)
	if pt.ConsumerTx != 625 || pt.messagesPerTx() != 1.6 {
		t.Fatalf("125 batches of 500 messages in 1,000 events: %d transactions, %v messages/tx", pt.ConsumerTx, pt.messagesPerTx())
	}
}

// insertedAt reads the insert time of a latencyEvent's payload as written
// and as jsonb returns it, and decodes anything else.
func TestInsertedAt(t *testing.T) {
	written := latencyEvent(7, time.Unix(0, 1733456789123456789)).Payload
	for _, tc := range []struct {
		name    string
		payload string
		want    int64
		ok      bool
	}{
		{"as written", string(written), 1733456789123456789, true},
		{"jsonb", `{"ins": 42, "seq": 7, "note": "x", "customer": "customer-7"}`, 42, true},
		{"alone", `{"ins": 42}`, 42, true},
		{"another order", `{"seq": 7, "ins": 42}`, 42, true},
		{"no space", `{"ins":42}`, 42, true},
		{"a fraction", `{"ins": 4.5}`, 0, false},
		{"zero", `{"ins": 0}`, 0, false},
		{"none", `{"seq": 7}`, 0, false},
		{"not JSON", `{"ins": 42`, 0, false},
	} {
		got, ok := insertedAt([]byte(tc.payload))
		if got != tc.want || ok != tc.ok {
			t.Errorf("%s: insertedAt(%s) = %d, %v; want %d, %v", tc.name, tc.payload, got, ok, tc.want, tc.ok)
		}
	}
}
