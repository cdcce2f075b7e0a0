package main

import (
	"bufio"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// consumerAppName is the application_name of a member process's
// connections, by which the load phase counts their backends' CPU.
const consumerAppName = "outbox-bench-consumer"

// natsCommand is the hidden subcommand that runs the test harness's NATS
// server in a process of its own, so that its CPU is not the bench's.
const natsCommand = "nats-server"

// runNATS starts a JetStream server, prints its URL on stdout and serves
// until SIGTERM.
func runNATS(args []string) error {
	fs := flag.NewFlagSet(natsCommand, flag.ContinueOnError)
	if err := fs.Parse(args); err != nil {
		return err
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, os.Interrupt)
	n, err := testenv.StartNATS()
	if err != nil {
		return err
	}
	defer n.Close()
	fmt.Println(n.URL)
	<-sig
	return nil
}

// natsProc is a NATS server child process.
type natsProc struct {
	cmd *exec.Cmd
	url string
}

// startNATSProc starts this binary as natsCommand and waits for its URL.
func startNATSProc() (*natsProc, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self, natsCommand)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &natsProc{cmd: cmd}
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		p.stop()
		return nil, fmt.Errorf("nats-server child: %w", err)
	}
	p.url = strings.TrimSpace(line)
	return p, nil
}

func (p *natsProc) pid() int { return p.cmd.Process.Pid }

func (p *natsProc) stop() {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = p.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		_ = p.cmd.Process.Kill()
		<-done
	}
}

// procSample is a process's CPU time and context switches, all threads.
// A voluntary switch is the thread blocking (to be woken again later): the
// wake-ups of a process that mostly waits.
type procSample struct {
	CPU         time.Duration
	Voluntary   int64
	Involuntary int64
}

func (a procSample) sub(b procSample) procSample {
	return procSample{CPU: a.CPU - b.CPU, Voluntary: a.Voluntary - b.Voluntary, Involuntary: a.Involuntary - b.Involuntary}
}

func (a procSample) add(b procSample) procSample {
	return procSample{CPU: a.CPU + b.CPU, Voluntary: a.Voluntary + b.Voluntary, Involuntary: a.Involuntary + b.Involuntary}
}

// sampleProc reads pid's CPU from /proc/<pid>/stat and the context switches
// of each of its threads from /proc/<pid>/task/*/status.
func sampleProc(pid int) (procSample, error) {
	var s procSample
	cpu, err := procCPU(pid)
	if err != nil {
		return s, err
	}
	s.CPU = cpu
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/status", pid))
	for _, t := range tasks {
		b, err := os.ReadFile(t)
		if err != nil {
			continue // the thread exited
		}
		for _, line := range strings.Split(string(b), "\n") {
			k, v, ok := strings.Cut(line, ":")
			if !ok {
				continue
			}
			n, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			switch k {
			case "voluntary_ctxt_switches":
				s.Voluntary += n
			case "nonvoluntary_ctxt_switches":
				s.Involuntary += n
			}
		}
	}
	return s, nil
}

// sampleTree samples root and each of its direct children (a postmaster
// and its backends) by pid.
func sampleTree(root int) map[int]procSample {
	out := map[int]procSample{}
	if root <= 0 {
		return out
	}
	if s, err := sampleProc(root); err == nil {
		out[root] = s
	}
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if ppid, err := procPPID(pid); err == nil && ppid == root {
			if s, err := sampleProc(pid); err == nil {
				out[pid] = s
			}
		}
	}
	return out
}

// treeDelta is what each process of a tree used between two samples; a
// process started meanwhile counts from zero, one that exited is lost.
func treeDelta(before, after map[int]procSample) map[int]procSample {
	out := make(map[int]procSample, len(after))
	for pid, a := range after {
		out[pid] = a.sub(before[pid])
	}
	return out
}

// appliedTimes collects, in a member process, each applied event's insert
// time (the payload's ins) and commit time.
type appliedTimes struct {
	mu    sync.Mutex
	pairs []int64
}

func (a *appliedTimes) add(payload []byte, applied int64) {
	ins, ok := insertedAt(payload)
	if !ok {
		return
	}
	a.mu.Lock()
	a.pairs = append(a.pairs, ins, applied)
	a.mu.Unlock()
}

func (a *appliedTimes) write(path string) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := bufio.NewWriter(f)
	err = binary.Write(w, binary.LittleEndian, a.pairs)
	return errors.Join(err, w.Flush(), f.Close())
}

// readAppliedTimes returns insert→applied of the events inserted at or
// after from, from a member's latency-out file.
func readAppliedTimes(path string, from time.Time) ([]time.Duration, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	pairs := make([]int64, len(b)/8)
	if _, err := binary.Decode(b, binary.LittleEndian, pairs); err != nil {
		return nil, err
	}
	var out []time.Duration
	for i := 0; i+1 < len(pairs); i += 2 {
		if pairs[i] >= from.UnixNano() {
			out = append(out, time.Duration(pairs[i+1]-pairs[i]))
		}
	}
	return out, nil
}
