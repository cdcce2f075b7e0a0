package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// relayProc is the real outbox-relay binary running as a child process, so
// its CPU time and peak RSS are its own.
type relayProc struct {
	cmd      *exec.Cmd
	done     chan error
	stream   string
	dlq      string
	subject  string
	slot     string
	httpAddr string // pprof listener, "" when off
	logPath  string
}

// startRelay writes a configuration for db's slot and starts bin on it. The
// relay creates its streams; they are deleted by stop.
func startRelay(o *options, env *benchEnv, db *benchDB, slot string, pprofOn bool) (*relayProc, error) {
	bin, workDir := o.relayBin, o.workDir
	stream, subject := streamNames("relay")
	r := &relayProc{stream: stream, dlq: stream + "_DLQ", subject: subject, slot: slot, done: make(chan error, 1)}
	listen := ""
	if pprofOn {
		port, err := testenv.FreePort()
		if err != nil {
			return nil, err
		}
		r.httpAddr = fmt.Sprintf("127.0.0.1:%d", port)
		listen = r.httpAddr
	}
	cfg := fmt.Sprintf(`postgres:
  url: %q
  slot: %s
  publication: %s
  auto_setup: false
nats:
  url: %q
  stream: %s
  dead_letter_stream: %s
  create_streams: true
tables:
  - table: public.outbox
    subject: "%s.{aggregate_type}.{aggregate_id}"
dead_letter_subject: %s_dlq
http:
  listen: %q
  pprof: %t
log:
  level: warn
%s`, db.url, slot, db.publication, env.natsURL, r.stream, r.dlq, subject, subject, listen, pprofOn, o.relayConfig)
	cfgPath := filepath.Join(workDir, slot+".yaml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		return nil, err
	}
	r.logPath = filepath.Join(workDir, slot+".log")
	logf, err := os.Create(r.logPath)
	if err != nil {
		return nil, err
	}
	r.cmd = exec.Command(bin, "run", "--config", cfgPath)
	r.cmd.Stdout, r.cmd.Stderr = logf, logf
	r.cmd.Env = append(os.Environ(), o.relayEnv...)
	if err := r.cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	go func() {
		r.done <- r.cmd.Wait()
		logf.Close()
	}()
	return r, nil
}

func (r *relayProc) pid() int { return r.cmd.Process.Pid }

// exited reports a relay that stopped on its own, with its log's tail.
func (r *relayProc) exited() error {
	select {
	case err := <-r.done:
		r.done <- err
		return fmt.Errorf("relay exited early (%v); log %s:\n%s", err, r.logPath, tail(r.logPath, 2000))
	default:
		return nil
	}
}

// stop sends SIGTERM, waits for a clean exit and returns the peak RSS
// (VmHWM) it had before the signal. (Not the rusage's Maxrss: Linux carries
// the parent's high-water mark across the vfork+exec that starts a child.)
func (r *relayProc) stop(env *benchEnv) (peakRSS int64, err error) {
	peakRSS, _ = procHWM(r.pid())
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err = <-r.done:
	case <-time.After(30 * time.Second):
		_ = r.cmd.Process.Kill()
		err = <-r.done
		err = fmt.Errorf("relay ignored SIGTERM for 30s: %w", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_ = env.js.DeleteStream(ctx, r.stream)
	_ = env.js.DeleteStream(ctx, r.dlq)
	return peakRSS, err
}

// profile fetches a CPU profile of the relay over seconds into path.
func (r *relayProc) profile(ctx context.Context, seconds int, path string) error {
	return r.fetch(ctx, "profile", seconds, path)
}

// fetch writes the relay's /debug/pprof/<kind> over seconds (profile:
// CPU; trace: an execution trace) to path.
func (r *relayProc) fetch(ctx context.Context, kind string, seconds int, path string) error {
	if r.httpAddr == "" {
		return errors.New("pprof is off")
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("http://%s/debug/pprof/%s?seconds=%d", r.httpAddr, kind, seconds), nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("pprof: %s", resp.Status)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// streamState returns the message count and first/last store times of a
// stream; zero values while it does not exist.
func streamState(ctx context.Context, js jetstream.JetStream, name string) (jetstream.StreamState, error) {
	s, err := js.Stream(ctx, name)
	if err != nil {
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			return jetstream.StreamState{}, nil
		}
		return jetstream.StreamState{}, err
	}
	info, err := s.Info(ctx)
	if err != nil {
		return jetstream.StreamState{}, err
	}
	return info.State, nil
}

// drainRelay runs the relay on a pre-loaded backlog of events rows in slot
// until the stream holds all of them. The rate is over the stream's own
// clock: first stored message to last. CPU and walsender CPU are sampled
// at the first stored message and at the last.
//
// With profileName set, the relay's pprof listener is on and a CPU profile
// of profileSecs seconds from the first stored message is written to
// o.profileDir.
func drainRelay(ctx context.Context, o *options, env *benchEnv, db *benchDB, slot string, events int64, profileName string, profileSecs int) (drainResult, error) {
	var d drainResult
	r, err := startRelay(o, env, db, slot, profileName != "")
	if err != nil {
		return d, err
	}
	stopped := false
	defer func() {
		if !stopped {
			_, _ = r.stop(env)
		}
	}()
	start := time.Now()
	deadline := start.Add(o.drainTimeout)
	poll := 10 * time.Millisecond
	var (
		cpu0, ws0 time.Duration
		b0        time.Duration
		t0        time.Time
		m0        machineCPU
		wsPID     int
		first     bool
		profErr   = make(chan error, 1)
		st        jetstream.StreamState
	)
	for {
		if err := r.exited(); err != nil {
			return d, err
		}
		if time.Now().After(deadline) {
			return d, fmt.Errorf("relay stored %d of %d events within %s; log %s:\n%s", st.Msgs, events, o.drainTimeout, r.logPath, tail(r.logPath, 2000))
		}
		st, err = streamState(ctx, env.js, r.stream)
		if err != nil {
			return d, err
		}
		if !first && st.Msgs > 0 {
			first = true
			cpu0, _ = procCPU(r.pid())
			m0, b0, t0 = readMachineCPU(), selfCPU(), time.Now()
			if wsPID = db.walsenderPID(ctx, slot); wsPID != 0 {
				ws0, _ = procCPU(wsPID)
			}
			poll = 50 * time.Millisecond
			if profileName != "" {
				go func() { profErr <- r.profile(ctx, max(1, profileSecs), filepath.Join(o.profileDir, profileName)) }()
				d.Profile = filepath.Join(o.profileDir, profileName)
			}
		}
		if st.Msgs >= uint64(events) {
			break
		}
		select {
		case <-ctx.Done():
			return d, ctx.Err()
		case <-time.After(poll):
		}
	}
	cpu1, _ := procCPU(r.pid())
	d.MachineCores = busyCores(m0, readMachineCPU())
	if env.nats != nil {
		d.NATSCores = (selfCPU() - b0).Seconds() / time.Since(t0).Seconds()
	}
	if wsPID != 0 {
		if ws1, err := procCPU(wsPID); err == nil {
			d.WalsenderCPU = ws1.Seconds() - ws0.Seconds()
		}
	}
	d.WallSeconds = time.Since(start).Seconds()
	d.Events = int64(st.Msgs)
	d.Seconds = st.LastTime.Sub(st.FirstTime).Seconds()
	d.CPUSeconds = (cpu1 - cpu0).Seconds()
	if d.Seconds > 0 {
		d.WalsenderCPU /= d.Seconds
	}
	if d.Profile != "" {
		if err := <-profErr; err != nil {
			return d, fmt.Errorf("profile: %w", err)
		}
	}
	dl, err := streamState(ctx, env.js, r.dlq)
	if err != nil {
		return d, err
	}
	if dl.Msgs != 0 || st.Msgs != uint64(events) {
		return d, fmt.Errorf("relay stored %d events (want %d) and %d dead letters (want 0)", st.Msgs, events, dl.Msgs)
	}
	stopped = true
	rss, err := r.stop(env)
	if err != nil {
		return d, err
	}
	d.PeakRSSMB = float64(rss) / (1 << 20)
	finish(&d)
	return d, nil
}

func tail(path string, n int) string {
	b, _ := os.ReadFile(path)
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}
