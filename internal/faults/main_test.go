package faults

import (
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// chaos selects the long variants (make chaos).
var chaos = os.Getenv("OUTBOX_CHAOS") == "1"

func TestMain(m *testing.M) {
	// The fault tests mostly wait for timeouts and restarts, not for CPU:
	// run more of them at once than the default of GOMAXPROCS, unless the
	// caller chose -parallel.
	flag.Parse()
	parallelSet := false
	flag.Visit(func(f *flag.Flag) { parallelSet = parallelSet || f.Name == "test.parallel" })
	if !parallelSet {
		_ = flag.Set("test.parallel", "6")
	}
	code := testenv.Main(m)
	closeShared()
	if len(summary.rows) > 0 && (chaos || testing.Verbose()) {
		printSummary(os.Stdout)
		if path := os.Getenv("OUTBOX_CHAOS_REPORT"); path != "" {
			if f, err := os.Create(path); err == nil {
				printSummary(f)
				_ = f.Close()
			}
		}
	}
	os.Exit(code)
}

// faultRow is one line of the summary table.
type faultRow struct {
	Fault      string
	Events     int
	Missing    int
	OutOfOrder int
	Duplicates int
	LSNAhead   int           // samples where the slot confirmed an unstored event
	Recovery   time.Duration // from the fault's end to the relay publishing again
	Note       string
}

var summary struct {
	mu   sync.Mutex
	rows []faultRow
}

// record adds a row to the summary table.
func record(r faultRow) {
	summary.mu.Lock()
	summary.rows = append(summary.rows, r)
	summary.mu.Unlock()
}

func printSummary(w io.Writer) {
	summary.mu.Lock()
	rows := append([]faultRow(nil), summary.rows...)
	summary.mu.Unlock()
	sort.SliceStable(rows, func(i, j int) bool { return rows[i].Fault < rows[j].Fault })
	fmt.Fprintln(w)
	fmt.Fprintf(w, "%-44s %8s %8s %9s %11s %9s %10s  %s\n", "fault", "events", "missing", "disorder", "duplicates", "lsn-ahead", "recovery", "note")
	fmt.Fprintln(w, strings.Repeat("-", 120))
	for _, r := range rows {
		rec := "-"
		if r.Recovery > 0 {
			rec = r.Recovery.Round(10 * time.Millisecond).String()
		}
		fmt.Fprintf(w, "%-44s %8d %8d %9d %11d %9d %10s  %s\n", r.Fault, r.Events, r.Missing, r.OutOfOrder, r.Duplicates, r.LSNAhead, rec, r.Note)
	}
}
