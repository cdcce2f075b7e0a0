package main

import (
	"slices"
	"strings"
	"testing"
	"time"
)

func TestStalls(t *testing.T) {
	ms := time.Millisecond
	for _, tc := range []struct {
		name  string
		bySeq map[int]time.Duration
		want  []int
	}{
		{"none", map[int]time.Duration{1: ms, 2: 2 * ms, 3: ms}, nil},
		{"one pause, counted once", map[int]time.Duration{1: ms, 2: 40 * ms, 3: 30 * ms, 4: 5 * ms, 5: 12 * ms, 6: ms}, []int{2}},
		{"two pauses, out of order in the map", map[int]time.Duration{9: 20 * ms, 1: ms, 8: ms, 2: 11 * ms, 3: ms}, []int{2, 9}},
	} {
		if got := stalls(tc.bySeq); !slices.Equal(got, tc.want) {
			t.Errorf("%s: stalls %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestPositiveInts(t *testing.T) {
	got, err := positiveInts("--rates", " 1000, 2000,,5000 ")
	if err != nil || !slices.Equal(got, []int{1000, 2000, 5000}) {
		t.Fatalf("got %v, %v", got, err)
	}
	for _, bad := range []string{"0", "-5", "1k"} {
		if _, err := positiveInts("--rows-per-tx", bad); err == nil || !strings.Contains(err.Error(), "--rows-per-tx") {
			t.Errorf("%q: %v", bad, err)
		}
	}
}

func TestBudgetLine(t *testing.T) {
	b := backlogResult{Relay: drainResult{Rate: 50000, Seconds: 4, CPUSeconds: 2, MachineCores: 2, WalsenderCPU: 0.5, NATSCores: 0.9}, RatioCeiling: 0.625}
	line := budgetLine(b)
	// 2 busy cores carry 50,000/s with the relay's 0.5: without it 1.5
	// cores would, so 2 cores carry 66,667/s; the ceiling is 80,000/s.
	for _, want := range []string{"walsender 10.0", "NATS server+bench 18.0", "relay 10.0", "≤ 66,667/s", "(0.83 of the ceiling)"} {
		if !strings.Contains(line, want) {
			t.Errorf("budget line %q lacks %q", line, want)
		}
	}
	if budgetLine(backlogResult{}) != "" {
		t.Error("a budget line without figures")
	}
}

func TestGroupOverheadTarget(t *testing.T) {
	r := &results{Consumer: &consumerPhase{Workers: 8, GroupRuns: []consumerFigure{
		{Handler: "batch", BatchSize: 64, Processes: 1, Workers: 8, Rate: 30000},
		{Handler: "batch", BatchSize: 64, Processes: 3, Workers: 8, Rate: 18000, BenchMicrosPerEvent: 20},
		{Handler: "batch", BatchSize: 64, Processes: 1, Workers: 24, Plain: true, Rate: 20000, BenchMicrosPerEvent: 10},
	}}}
	var overhead, server, perProcess *target
	for _, tg := range judgeConsumer(r) {
		switch {
		case strings.HasPrefix(tg.Name, "group overhead"):
			overhead = &tg
		case strings.Contains(tg.Name, "NATS server CPU per event"):
			server = &tg
		case strings.Contains(tg.Name, "3 processes ÷ 1 process"):
			perProcess = &tg
		}
	}
	// The group against the plain durable with its 24 workers, not against
	// the 1-process group (the old target, now a figure to read it by).
	if overhead == nil || overhead.Value != 0.9 || overhead.Limit != 0.9 || !overhead.OK || overhead.Info {
		t.Errorf("group overhead target %+v, want 18,000 ÷ 20,000 = 0.9 judged ≥ 0.9", overhead)
	}
	if server == nil || server.Value != 2 || !server.Info {
		t.Errorf("server CPU ratio %+v, want 20 ÷ 10 µs = 2, not judged", server)
	}
	if perProcess == nil || perProcess.Value != 0.6 || !perProcess.Info {
		t.Errorf("3 ÷ 1 process %+v, want 0.6, not judged", perProcess)
	}
}
