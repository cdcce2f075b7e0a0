package watermark

import (
	"math/rand"
	"testing"
	"time"
)

func TestTrackerOrder(t *testing.T) {
	type step struct {
		op   string // begin, add, settle, commit
		tx   int
		lsn  LSN
		want LSN // Confirmed after the step
	}
	tests := []struct {
		name  string
		steps []step
	}{
		{"empty tx confirms at commit", []step{
			{"begin", 0, 0, 100}, {"commit", 0, 200, 200},
		}},
		{"waits for its ack", []step{
			{"begin", 0, 0, 100}, {"add", 0, 0, 100}, {"commit", 0, 200, 100}, {"settle", 0, 0, 200},
		}},
		{"later ack does not pass an earlier tx", []step{
			{"begin", 0, 0, 100}, {"add", 0, 0, 100}, {"commit", 0, 200, 100},
			{"begin", 1, 0, 100}, {"add", 1, 0, 100}, {"commit", 1, 300, 100},
			{"settle", 1, 0, 100}, {"settle", 0, 0, 300},
		}},
		{"settled before commit is seen", []step{
			{"begin", 0, 0, 100}, {"add", 0, 0, 100}, {"settle", 0, 0, 100}, {"commit", 0, 200, 200},
		}},
		{"open tx blocks", []step{
			{"begin", 0, 0, 100}, {"add", 0, 0, 100}, {"settle", 0, 0, 100},
			{"begin", 1, 0, 100}, {"commit", 1, 300, 100}, {"commit", 0, 200, 300},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tr := NewTracker(100)
			txs := map[int]*Tx{}
			for i, s := range tt.steps {
				switch s.op {
				case "begin":
					txs[s.tx] = tr.Begin(time.Now())
				case "add":
					txs[s.tx].Add()
				case "settle":
					txs[s.tx].Settle()
				case "commit":
					txs[s.tx].Commit(s.lsn)
				}
				if got := tr.Confirmed(); got != s.want {
					t.Fatalf("step %d (%s tx%d): Confirmed = %v, want %v", i, s.op, s.tx, got, s.want)
				}
			}
			if !tr.Idle() {
				t.Fatal("tracker not idle at the end")
			}
		})
	}
}

// TestTrackerRandom settles messages in random order and checks the
// watermark never passes an unsettled transaction.
func TestTrackerRandom(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	tr := NewTracker(0)
	type msg struct {
		tx  *Tx
		idx int
	}
	var open []msg
	settledTx := map[int]int{}
	sizes := map[int]int{}
	for i := 0; i < 2000; i++ {
		tx := tr.Begin(time.Now())
		n := rng.Intn(4)
		sizes[i] = n
		for j := 0; j < n; j++ {
			tx.Add()
			open = append(open, msg{tx, i})
		}
		tx.Commit(LSN((i + 1) * 10))
		for len(open) > 0 && rng.Intn(3) == 0 {
			k := rng.Intn(len(open))
			m := open[k]
			open = append(open[:k], open[k+1:]...)
			m.tx.Settle()
			settledTx[m.idx]++
		}
		// Every transaction at or below the watermark is fully settled.
		c := int(tr.Confirmed()) / 10
		for j := 0; j < c; j++ {
			if settledTx[j] != sizes[j] {
				t.Fatalf("watermark %d passed tx %d with %d/%d settled", tr.Confirmed(), j, settledTx[j], sizes[j])
			}
		}
	}
	for _, m := range open {
		m.tx.Settle()
	}
	if tr.Confirmed() != 20000 || !tr.Idle() {
		t.Fatalf("final watermark %v idle=%v", tr.Confirmed(), tr.Idle())
	}
}

func BenchmarkTrackerOneRowTx(b *testing.B) {
	tr := NewTracker(0)
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		tx := tr.Begin(time.Time{})
		tx.Add()
		tx.Commit(LSN(i + 1))
		tx.Settle()
	}
}

// The unsettled tail (issue 16, case 2): transactions and WAL bytes behind
// the watermark, measured from the start position, and the signal that
// the watermark moved.
func TestTrackerUnsettled(t *testing.T) {
	tr := NewTracker(0)
	tr.Raise(1000)
	tr.Raise(10) // never backwards
	if tr.Confirmed() != 1000 {
		t.Fatalf("confirmed %s", tr.Confirmed())
	}
	stuck := tr.Begin(time.Time{})
	stuck.Add()
	if tr.WaitingForAcks() {
		t.Fatal("waiting for acks while the oldest transaction is still being read")
	}
	stuck.Commit(1100)
	if !tr.WaitingForAcks() {
		t.Fatal("not waiting for acks with a committed transaction unsettled")
	}
	for i := range 3 {
		tx := tr.Begin(time.Time{})
		tx.Add()
		tx.Settle()
		tx.Commit(LSN(1200 + 100*i))
	}
	if txs, b := tr.Unsettled(); txs != 4 || b != 400 {
		t.Fatalf("unsettled %d txs, %d bytes; want 4, 400", txs, b)
	}
	select {
	case <-tr.Advanced():
		t.Fatal("signalled while the watermark stood still")
	default:
	}
	stuck.Settle()
	select {
	case <-tr.Advanced():
	default:
		t.Fatal("no signal when the watermark moved")
	}
	if txs, b := tr.Unsettled(); txs != 0 || b != 0 || tr.Confirmed() != 1400 {
		t.Fatalf("unsettled %d txs, %d bytes, confirmed %s", txs, b, tr.Confirmed())
	}
}
