package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// readerCommand is the hidden subcommand that runs the bare decode reader in
// a process of its own, so its CPU time is its alone (the embedded NATS
// server shares the bench process).
const readerCommand = "decode-reader"

// readerReport is what the bare reader prints on stdout.
type readerReport struct {
	Inserts      int64         `json:"inserts"`
	Txs          int64         `json:"txs"`
	Bytes        int64         `json:"bytes"`
	Active       time.Duration `json:"active_ns"`        // first XLogData to the last commit
	CPU          time.Duration `json:"cpu_ns"`           // the reader's CPU over Active
	WalsenderCPU time.Duration `json:"walsender_cpu_ns"` // the walsender's CPU over Active
	MachineCores float64       `json:"machine_cores"`    // busy cores over Active
	PeakRSS      int64         `json:"peak_rss"`         // VmHWM, bytes
	// CommitToReceive (with -latency): commit timestamp to receipt of the
	// Commit message, for the commits after the skipped ones.
	CommitToReceive quantiles `json:"commit_to_receive"`
}

// runReader is the bare pglogrepl reader: it parses every pgoutput message
// with pglogrepl.Parse, touches every column of every insert, confirms what
// it received once a second, and publishes nothing. It stops after the
// commit that follows the events-th insert.
func runReader(args []string) error {
	fs := flag.NewFlagSet(readerCommand, flag.ContinueOnError)
	dsn := fs.String("url", "", "database URL")
	slot := fs.String("slot", "", "slot")
	pub := fs.String("publication", "", "publication")
	events := fs.Int64("events", 0, "inserts to read")
	cpuprofile := fs.String("cpuprofile", "", "write a CPU profile")
	latency := fs.Bool("latency", false, "record each commit's commit→receive latency")
	latencySkip := fs.Int64("latency-skip", 0, "with -latency: do not record the first this many commits (warm-up)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cfg, err := pgconn.ParseConfig(*dsn)
	if err != nil {
		return err
	}
	cfg.RuntimeParams["replication"] = "database"
	conn, err := pgconn.ConnectConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	walsender := int(conn.PID())
	err = pglogrepl.StartReplication(ctx, conn, *slot, 0, pglogrepl.StartReplicationOptions{
		Mode:       pglogrepl.LogicalReplication,
		PluginArgs: []string{"proto_version '1'", "publication_names '" + *pub + "'"},
	})
	if err != nil {
		return fmt.Errorf("start replication: %w", err)
	}
	if *cpuprofile != "" {
		stop, err := startProfile(*cpuprofile)
		if err != nil {
			return err
		}
		defer stop()
	}

	var rep readerReport
	var (
		started             bool
		t0                  time.Time
		cpu0, ws0           time.Duration
		m0                  machineCPU
		received, confirmed pglogrepl.LSN
		columnBytes         int
		relations           = map[uint32]*pglogrepl.RelationMessage{}
		latencies           []time.Duration
		statusEvery         = time.Second
		nextStatus          = time.Now().Add(statusEvery)
	)
	// The read deadline is set once per status interval, and reads pass
	// context.Background() so that pgconn sets up no context watch per
	// message: the reader's own overhead stays far below the walsender's.
	nc := conn.Conn()
	if err := nc.SetReadDeadline(nextStatus); err != nil {
		return err
	}
	for {
		if time.Now().After(nextStatus) {
			err := pglogrepl.SendStandbyStatusUpdate(ctx, conn, pglogrepl.StandbyStatusUpdate{WALWritePosition: received, WALFlushPosition: confirmed, WALApplyPosition: confirmed})
			if err != nil {
				return err
			}
			nextStatus = time.Now().Add(statusEvery)
			if err := nc.SetReadDeadline(nextStatus); err != nil {
				return err
			}
		}
		raw, err := conn.ReceiveMessage(context.Background())
		if err != nil {
			if pgconn.Timeout(err) && ctx.Err() == nil {
				continue
			}
			return fmt.Errorf("receive: %w", err)
		}
		cd, ok := raw.(*pgproto3.CopyData)
		if !ok {
			if e, ok := raw.(*pgproto3.ErrorResponse); ok {
				return pgconn.ErrorResponseToPgError(e)
			}
			return fmt.Errorf("unexpected %T", raw)
		}
		switch cd.Data[0] {
		case pglogrepl.PrimaryKeepaliveMessageByteID:
			ka, err := pglogrepl.ParsePrimaryKeepaliveMessage(cd.Data[1:])
			if err != nil {
				return err
			}
			if ka.ReplyRequested {
				nextStatus = time.Time{}
			}
		case pglogrepl.XLogDataByteID:
			if !started {
				started, t0, cpu0, m0 = true, time.Now(), selfCPU(), readMachineCPU()
				ws0, _ = procCPU(walsender)
			}
			xld, err := pglogrepl.ParseXLogData(cd.Data[1:])
			if err != nil {
				return err
			}
			rep.Bytes += int64(len(cd.Data))
			if xld.WALStart > received {
				received = xld.WALStart
			}
			msg, err := pglogrepl.Parse(xld.WALData)
			if err != nil {
				return fmt.Errorf("parse: %w", err)
			}
			switch m := msg.(type) {
			case *pglogrepl.RelationMessage:
				relations[m.RelationID] = m
			case *pglogrepl.BeginMessage:
			case *pglogrepl.InsertMessage:
				if _, ok := relations[m.RelationID]; !ok {
					return fmt.Errorf("insert before relation %d", m.RelationID)
				}
				for _, c := range m.Tuple.Columns {
					columnBytes += len(c.Data)
				}
				rep.Inserts++
			case *pglogrepl.CommitMessage:
				if *latency && rep.Txs >= *latencySkip {
					latencies = append(latencies, time.Since(m.CommitTime))
				}
				rep.Txs++
				confirmed = m.TransactionEndLSN
				if rep.Inserts >= *events {
					rep.Active = time.Since(t0)
					rep.CPU = selfCPU() - cpu0
					if ws, err := procCPU(walsender); err == nil {
						rep.WalsenderCPU = ws - ws0
					}
					rep.MachineCores = busyCores(m0, readMachineCPU())
					rep.PeakRSS, _ = procHWM(os.Getpid())
					rep.CommitToReceive = quantilesOf(latencies)
					_ = pglogrepl.SendStandbyStatusUpdate(ctx, conn, pglogrepl.StandbyStatusUpdate{WALWritePosition: received, WALFlushPosition: confirmed, WALApplyPosition: confirmed})
					_ = columnBytes
					return json.NewEncoder(os.Stdout).Encode(rep)
				}
			}
		}
	}
}

// drainResult is one reader's drain of a backlog.
type drainResult struct {
	Events       int64   `json:"events"`
	Seconds      float64 `json:"seconds"`         // active window: first message to last
	WallSeconds  float64 `json:"wall_seconds"`    // process start to done
	Rate         float64 `json:"events_per_sec"`  // Events / Seconds
	CPUSeconds   float64 `json:"cpu_seconds"`     // the reader's CPU over the active window
	CPUPer100k   float64 `json:"cpu_s_per_100k"`  // CPUSeconds per 100,000 events
	PeakRSSMB    float64 `json:"peak_rss_mb"`     // 0 when not measured
	WalsenderCPU float64 `json:"walsender_cores"` // walsender CPU / active seconds
	MachineCores float64 `json:"machine_cores"`   // busy cores over the window
	// NATSCores (relay drains with the embedded server) is this process's
	// CPU over the window: the NATS server, and the bench polling it.
	NATSCores float64 `json:"nats_bench_cores,omitempty"`
	Profile   string  `json:"profile,omitempty"`
}

func finish(d *drainResult) {
	if d.Seconds > 0 {
		d.Rate = float64(d.Events) / d.Seconds
	}
	if d.Events > 0 {
		d.CPUPer100k = d.CPUSeconds / float64(d.Events) * 100000
	}
}

// readerProc is the bare reader running in a child process of its own.
type readerProc struct {
	cmd  *exec.Cmd
	out  strings.Builder
	done chan error // the process's exit, once
}

// startReader starts the bare reader on slot until it has read events
// inserts; extra are further reader flags.
func startReader(ctx context.Context, db *benchDB, slot string, events int64, extra ...string) (*readerProc, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	args := append([]string{readerCommand, "-url", db.url, "-slot", slot, "-publication", db.publication, "-events", fmt.Sprint(events)}, extra...)
	p := &readerProc{cmd: exec.CommandContext(ctx, self, args...), done: make(chan error, 1)}
	p.cmd.Stdout, p.cmd.Stderr = &p.out, os.Stderr
	if err := p.cmd.Start(); err != nil {
		return nil, err
	}
	go func() { p.done <- p.cmd.Wait() }()
	return p, nil
}

// report waits for the reader to finish and returns what it printed.
func (p *readerProc) report() (readerReport, error) {
	var rep readerReport
	if err := <-p.done; err != nil {
		return rep, fmt.Errorf("decode reader: %w", err)
	}
	if err := json.Unmarshal([]byte(p.out.String()), &rep); err != nil {
		return rep, fmt.Errorf("decode reader output %q: %w", p.out.String(), err)
	}
	return rep, nil
}

// kill stops the reader and waits for it.
func (p *readerProc) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// decodeCeiling runs the bare reader on slot in a child process.
func decodeCeiling(ctx context.Context, db *benchDB, slot string, events int64, profile string) (drainResult, error) {
	var extra []string
	if profile != "" {
		extra = append(extra, "-cpuprofile", profile)
	}
	start := time.Now()
	p, err := startReader(ctx, db, slot, events, extra...)
	if err != nil {
		return drainResult{}, err
	}
	rep, err := p.report()
	if err != nil {
		return drainResult{}, err
	}
	d := drainResult{
		Events:       rep.Inserts,
		Seconds:      rep.Active.Seconds(),
		WallSeconds:  time.Since(start).Seconds(),
		CPUSeconds:   rep.CPU.Seconds(),
		MachineCores: rep.MachineCores,
		Profile:      profile,
	}
	// Not the rusage's Maxrss: Linux carries the parent's high-water mark
	// across the vfork+exec that starts a child.
	d.PeakRSSMB = float64(rep.PeakRSS) / (1 << 20)
	if d.Seconds > 0 {
		d.WalsenderCPU = rep.WalsenderCPU.Seconds() / d.Seconds
	}
	finish(&d)
	return d, nil
}

// recvlogical drains slot with PostgreSQL's own pg_recvlogical up to endpos,
// writing the pgoutput stream to /dev/null. Its time is wall time, process
// start included.
func recvlogical(ctx context.Context, db *benchDB, slot string, events int64, endpos string) (*drainResult, error) {
	bin := filepath.Join(db.env.pgBin, "pg_recvlogical")
	if _, err := os.Stat(bin); err != nil {
		p, lerr := exec.LookPath("pg_recvlogical")
		if lerr != nil {
			return nil, nil // not installed: reported as absent
		}
		bin = p
	}
	cmd := exec.CommandContext(ctx, bin, "-d", db.url, "-S", slot, "--start", "--no-loop",
		"-o", "proto_version=1", "-o", "publication_names="+db.publication,
		"-E", endpos, "-f", "/dev/null")
	cmd.Stdout = io.Discard
	cmd.Stderr = os.Stderr
	m0 := readMachineCPU()
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	// Sample the walsender while it lives.
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	var ws0, wsLast time.Duration
	var hwm int64
	wsPID := 0
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	var werr error
wait:
	for {
		select {
		case werr = <-done:
			break wait
		case <-tick.C:
			if v, err := procHWM(cmd.Process.Pid); err == nil {
				hwm = v
			}
			if wsPID == 0 {
				if wsPID = db.walsenderPID(ctx, slot); wsPID != 0 {
					ws0, _ = procCPU(wsPID)
					wsLast = ws0
				}
			} else if c, err := procCPU(wsPID); err == nil {
				wsLast = c
			}
		}
	}
	if werr != nil {
		return nil, fmt.Errorf("pg_recvlogical: %w", werr)
	}
	wall := time.Since(start)
	d := &drainResult{Events: events, Seconds: wall.Seconds(), WallSeconds: wall.Seconds(), MachineCores: busyCores(m0, readMachineCPU())}
	d.CPUSeconds = (cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()).Seconds()
	d.PeakRSSMB = float64(hwm) / (1 << 20) // sampled every 20ms
	d.WalsenderCPU = (wsLast - ws0).Seconds() / wall.Seconds()
	finish(d)
	return d, nil
}
