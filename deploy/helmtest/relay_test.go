package helmtest

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// The key check above compares names with testdata/full.yaml; this one
// hands the rendered configuration and environment to the relay itself,
// built from this repository, as the pod would: its own parser and
// validation must accept them. PostgreSQL and NATS are unreachable on
// purpose: the relay then waits for them (alive on /healthz, not Ready),
// which is only reached once the configuration is accepted; a refused
// configuration exits at once, naming the key.

var (
	relayOnce sync.Once
	relayDir  string // created and removed by TestMain
	relayBin  string
	relayErr  error
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "helmtest-relay")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	relayDir = dir
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// relayBinary builds cmd/outbox-relay once per test run.
func relayBinary(t *testing.T) string {
	t.Helper()
	relayOnce.Do(func() {
		relayBin = filepath.Join(relayDir, "outbox-relay")
		cmd := exec.Command("go", "build", "-o", relayBin, "./cmd/outbox-relay")
		cmd.Dir = "../.."
		if out, err := cmd.CombinedOutput(); err != nil {
			relayErr = fmt.Errorf("go build ./cmd/outbox-relay: %w\n%s", err, out)
		}
	})
	if relayErr != nil {
		t.Fatal(relayErr)
	}
	return relayBin
}

// Stand-ins for the Secret's values: servers nobody listens on.
var fakeSecretValues = map[string]string{
	"OUTBOX_RELAY_POSTGRES_URL":  "postgres://outbox_relay:secret@127.0.0.1:1/app?sslmode=disable&connect_timeout=1",
	"OUTBOX_RELAY_NATS_URL":      "nats://127.0.0.1:1",
	"OUTBOX_RELAY_NATS_USER":     "relay",
	"OUTBOX_RELAY_NATS_PASSWORD": "secret",
}

// runRelay starts the relay with the pod's configuration file and
// environment, files under /etc/outbox-relay moved to a temporary
// directory, and reports whether it accepted them: nil once it serves
// /healthz and waits for its servers, the relay's output otherwise.
func runRelay(t *testing.T, m *manifest, config string) error {
	t.Helper()
	bin := relayBinary(t)
	root := t.TempDir()
	local := func(p string) string {
		return filepath.Join(root, strings.TrimPrefix(p, "/etc/outbox-relay/"))
	}
	if err := os.WriteFile(local(configPath), []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	env := []string{"PATH=" + os.Getenv("PATH"), "HOME=" + root,
		// Only the listen address differs from the pod (env beats file):
		// tests must not bind a fixed port.
		"OUTBOX_RELAY_HTTP_LISTEN=" + addr}
	c := container(t, m)
	for _, e := range c.Env {
		switch {
		case e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil:
			v, ok := fakeSecretValues[e.Name]
			if !ok {
				t.Fatalf("env %s from a Secret: no stand-in value", e.Name)
			}
			env = append(env, e.Name+"="+v)
		case strings.HasPrefix(e.Value, "/etc/outbox-relay/"):
			// A file mounted from the Secret: present, with made-up content.
			p := local(e.Value)
			if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, []byte("made up\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			env = append(env, e.Name+"="+p)
		case e.ValueFrom == nil:
			env = append(env, e.Name+"="+e.Value)
		default:
			t.Fatalf("env %s: %+v not handled by the test", e.Name, e.ValueFrom)
		}
	}
	args := append([]string(nil), c.Args...)
	for i, a := range args {
		if strings.HasPrefix(a, "/etc/outbox-relay/") {
			args[i] = local(a)
		}
	}

	var out strings.Builder
	cmd := exec.Command(bin, args...)
	cmd.Env, cmd.Stdout, cmd.Stderr = env, &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	stop := func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
	}

	deadline := time.Now().Add(30 * time.Second)
	for {
		select {
		case err := <-exited:
			return fmt.Errorf("the relay exited (%v) instead of waiting for its servers:\n%s", err, out.String())
		case <-time.After(100 * time.Millisecond):
		}
		if status(addr, "/healthz") == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			stop()
			return fmt.Errorf("no /healthz 200 within 30 s:\n%s", out.String())
		}
	}
	// Waiting for its servers: alive, and not Ready even as a standby.
	got := status(addr, c.ReadinessProbe.HTTPGet.Path)
	stop()
	if got != http.StatusServiceUnavailable {
		return fmt.Errorf("%s answered %d with no server reachable, want 503:\n%s", c.ReadinessProbe.HTTPGet.Path, got, out.String())
	}
	return nil
}

func status(addr, path string) int {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+path, nil)
	if err != nil {
		return 0
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func TestRelayAcceptsRenderedConfig(t *testing.T) {
	for name, values := range map[string]string{
		"defaults":        "",
		"existing secret": existingSecretValues,
		"created secret":  createdSecretValues,
	} {
		t.Run(name, func(t *testing.T) {
			m := mustRender(t, values)
			if err := runRelay(t, m, m.configMap.Data["config.yaml"]); err != nil {
				t.Fatal(err)
			}
		})
	}
	// The check has teeth: a key the relay does not know stops it.
	t.Run("refused", func(t *testing.T) {
		m := mustRender(t, "")
		err := runRelay(t, m, m.configMap.Data["config.yaml"]+"shutdown_timeot: 5s\n")
		if err == nil || !strings.Contains(err.Error(), "shutdown_timeot") {
			t.Fatalf("a misspelt key: %v, want the relay to exit naming it", err)
		}
		t.Logf("refused as it should be: %v", err)
	})
}
