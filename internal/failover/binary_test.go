package failover

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// The operator's side of a failover runs the outbox-relay binary (setup,
// reconcile, status, run), configured like the in-process relay.

// writeConfig writes the relay's configuration file for c, with the given
// keys ("http.listen") changed, and returns its path.
func (c *cluster) writeConfig(set map[string]any) string {
	c.t.Helper()
	cfg := map[string]any{
		"postgres": map[string]any{
			"url":             c.cfg.Replication.URL,
			"slot":            c.cfg.Replication.Slot,
			"publication":     c.cfg.Replication.Publication,
			"status_interval": "100ms",
			"receive_timeout": "3s",
			"failover_slot":   c.cfg.Replication.FailoverSlot,
		},
		"nats": map[string]any{
			"url":                c.natsURL,
			"stream":             c.stream,
			"stream_subjects":    []string{c.prefix + ".>"},
			"dead_letter_stream": c.cfg.DeadLetterStream.Name,
			"ack_timeout":        "2s",
		},
		"tables":              []any{map[string]any{"table": "public.outbox", "subject": c.prefix + ".{aggregate_type}.{aggregate_id}"}},
		"dead_letter_subject": c.prefix + "_dlq",
		"http":                map[string]any{"listen": ""},
		"log":                 map[string]any{"level": "info"},
	}
	for path, v := range set {
		keys := strings.Split(path, ".")
		m := cfg
		for _, k := range keys[:len(keys)-1] {
			sub, ok := m[k].(map[string]any)
			if !ok {
				sub = map[string]any{}
				m[k] = sub
			}
			m = sub
		}
		m[keys[len(keys)-1]] = v
	}
	b, err := yaml.Marshal(cfg)
	testenv.Must(c.t, err, "marshal config")
	f, err := os.CreateTemp(c.t.TempDir(), "relay-*.yaml")
	testenv.Must(c.t, err, "config file")
	_, err = f.Write(b)
	testenv.Must(c.t, err, "write config")
	testenv.Must(c.t, f.Close(), "close config")
	return f.Name()
}

// run runs the binary to completion, with env added to the environment,
// and returns its output and exit code.
func (c *cluster) run(timeout time.Duration, env []string, args ...string) (string, int) {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, testenv.BuildBinary(c.t, "./cmd/outbox-relay"), args...)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		return string(out), ee.ExitCode()
	case err != nil:
		c.t.Fatalf("outbox-relay %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out), 0
}

// process is the binary running in the background, its output in a file.
type process struct {
	cmd  *exec.Cmd
	log  string
	done chan struct{}
}

// start starts the binary; it is stopped (SIGTERM) when the test ends.
func (c *cluster) start(args ...string) *process {
	c.t.Helper()
	p := &process{log: filepath.Join(c.t.TempDir(), "relay.log"), done: make(chan struct{})}
	f, err := os.Create(p.log)
	testenv.Must(c.t, err, "log file")
	p.cmd = exec.Command(testenv.BuildBinary(c.t, "./cmd/outbox-relay"), args...)
	p.cmd.Stdout, p.cmd.Stderr = f, f
	testenv.Must(c.t, p.cmd.Start(), "start outbox-relay")
	f.Close()
	go func() {
		_ = p.cmd.Wait()
		close(p.done)
	}()
	c.t.Cleanup(func() {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
			_ = p.cmd.Process.Kill()
			<-p.done
		}
		if c.t.Failed() {
			c.t.Logf("outbox-relay log:\n%s", p.output())
		}
	})
	return p
}

func (p *process) output() string {
	b, _ := os.ReadFile(p.log)
	return string(b)
}

// waitLog waits until the log holds s.
func (p *process) waitLog(t *testing.T, s string, timeout time.Duration) {
	t.Helper()
	if !testenv.WaitFor(timeout, func() bool { return strings.Contains(p.output(), s) }) {
		t.Fatalf("the relay's log has no %q after %s:\n%s", s, timeout, p.output())
	}
}
