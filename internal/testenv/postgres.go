package testenv

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// Postgres is a private PostgreSQL cluster started with initdb, or an external
// server named by OUTBOX_TEST_POSTGRES_URL.
type Postgres struct {
	// AdminURL connects as the superuser to the "postgres" database.
	AdminURL string

	external bool
	server   pgServer
	dataDir  string
	sockDir  string
	port     int
	// chownTo says that files must be given to uid:gid, the server's
	// owner, because the tests run as root.
	chownTo  bool
	uid, gid int
	logFile  string
}

// PostgresOption adjusts the server configuration of a private cluster.
type PostgresOption func(*pgOptions)

type pgOptions struct {
	settings map[string]string
}

// WithSetting sets a postgresql.conf parameter of a private cluster, for
// example WithSetting("max_slot_wal_keep_size", "64MB").
func WithSetting(name, value string) PostgresOption {
	return func(o *pgOptions) { o.settings[name] = value }
}

// FindPGBin returns the directory holding initdb, pg_ctl and postgres: the one
// on PATH, else the newest /usr/lib/postgresql/*/bin.
func FindPGBin() (string, error) {
	if p, err := exec.LookPath("initdb"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			p = real
		}
		return filepath.Dir(p), nil
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool {
		vi, _ := strconv.Atoi(filepath.Base(filepath.Dir(dirs[i])))
		vj, _ := strconv.Atoi(filepath.Base(filepath.Dir(dirs[j])))
		return vi > vj
	})
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d, nil
		}
	}
	return "", fmt.Errorf("initdb not found on PATH nor in /usr/lib/postgresql/*/bin: install the PostgreSQL server (apt-get install postgresql) or set OUTBOX_TEST_POSTGRES_URL")
}

// StartPostgres initialises and starts a private cluster in a new temporary
// directory. Stop it with Close. It ignores OUTBOX_TEST_POSTGRES_URL: callers
// that need to stop or restart the server use it.
func StartPostgres(opts ...PostgresOption) (*Postgres, error) {
	o := pgOptions{settings: map[string]string{}}
	for _, opt := range opts {
		opt(&o)
	}
	server, err := selectServer()
	if err != nil {
		return nil, err
	}
	uid, gid, chownTo, err := server.owner()
	if err != nil {
		return nil, err
	}
	base, err := os.MkdirTemp(server.tempBase(), "outbox-relay-pg-")
	if err != nil {
		return nil, err
	}
	p := &Postgres{
		server:  server,
		dataDir: filepath.Join(base, "data"),
		sockDir: filepath.Join(base, "sock"),
		logFile: filepath.Join(base, "postgres.log"),
		chownTo: chownTo, uid: uid, gid: gid,
	}
	for _, d := range []string{p.dataDir, p.sockDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, err
		}
	}
	if err := p.chown(base); err != nil {
		_ = os.RemoveAll(base)
		return nil, err
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	p.port = port
	if out, err := p.run("initdb", "-D", p.dataDir, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-locale", "--no-sync"); err != nil {
		_ = os.RemoveAll(base)
		return nil, fmt.Errorf("initdb: %w\n%s", err, out)
	}
	settings := map[string]string{
		"wal_level":               "logical",
		"max_replication_slots":   "64",
		"max_wal_senders":         "64",
		"max_connections":         "200",
		"listen_addresses":        "'127.0.0.1'",
		"port":                    strconv.Itoa(port),
		"unix_socket_directories": "'" + p.server.inside(p.sockDir) + "'",
		"fsync":                   "off", // the OS does not crash in tests; restarts still go through WAL replay
		"synchronous_commit":      "off",
		"full_page_writes":        "off",
		"shared_buffers":          "128MB",
		"max_wal_size":            "1GB",
		"wal_sender_timeout":      "60s",
		"log_min_messages":        "warning",
	}
	for k, v := range o.settings {
		v, err := p.importFile(filepath.Join(base, "files"), v)
		if err != nil {
			return nil, err
		}
		settings[k] = v
	}
	if err := appendFile(filepath.Join(p.dataDir, "postgresql.conf"), confLines(settings)); err != nil {
		return nil, err
	}
	hba := "local all all trust\nlocal replication all trust\nhost all all 127.0.0.1/32 trust\nhost replication all 127.0.0.1/32 trust\n"
	if err := os.WriteFile(filepath.Join(p.dataDir, "pg_hba.conf"), []byte(hba), 0o600); err != nil {
		return nil, err
	}
	if err := p.chown(p.dataDir); err != nil {
		return nil, err
	}
	if err := p.startOnFreePort(); err != nil {
		p.Close()
		return nil, err
	}
	return p, nil
}

// freePort is FreePort, replaced by a test that hands out a taken port.
var freePort = FreePort

// startOnFreePort starts the new cluster, on another free port when its
// port was taken between FreePort and the server's bind: the port is free
// only when FreePort looks, and the parallel test packages' servers and
// outgoing connections draw from the same range ("could not bind IPv4
// address: Address already in use" failed a CI run).
func (p *Postgres) startOnFreePort() error {
	var err error
	for attempt := 1; ; attempt++ {
		p.AdminURL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", p.port)
		if err = p.Start(); err == nil || attempt == 3 {
			return err
		}
		port, perr := freePort()
		if perr != nil {
			return errors.Join(err, perr)
		}
		p.port = port // the last port line of postgresql.conf counts
		if aerr := appendFile(filepath.Join(p.dataDir, "postgresql.conf"), confLines(map[string]string{"port": strconv.Itoa(port)})); aerr != nil {
			return errors.Join(err, aerr)
		}
	}
}

func externalPostgres(url string) *Postgres {
	return &Postgres{AdminURL: url, external: true}
}

// Port returns the TCP port of a private cluster.
func (p *Postgres) Port() int { return p.port }

// Start starts a stopped private cluster and waits until it accepts connections.
func (p *Postgres) Start() error {
	if p.external {
		return fmt.Errorf("cannot start an external PostgreSQL server")
	}
	out, err := p.run("pg_ctl", "-D", p.dataDir, "-l", p.logFile, "-w", "-t", "60", "start")
	if err != nil {
		log, _ := os.ReadFile(p.logFile)
		return fmt.Errorf("pg_ctl start: %w\n%s\n%s", err, out, log)
	}
	return nil
}

// Stop stops a private cluster with the given shutdown mode: "fast" or
// "immediate" (a crash: recovery replays the WAL at the next start).
func (p *Postgres) Stop(mode string) error {
	if p.external {
		return fmt.Errorf("cannot stop an external PostgreSQL server")
	}
	out, err := p.run("pg_ctl", "-D", p.dataDir, "-m", mode, "-w", "-t", "60", "stop")
	if err != nil {
		return fmt.Errorf("pg_ctl stop -m %s: %w\n%s", mode, err, out)
	}
	return nil
}

// Close stops a private cluster and removes its files.
func (p *Postgres) Close() {
	if p.external {
		return
	}
	_ = p.Stop("immediate")
	_ = os.RemoveAll(filepath.Dir(p.dataDir))
}

// Log returns the server log of a private cluster, for test failure output.
func (p *Postgres) Log() string {
	b, _ := os.ReadFile(p.logFile)
	return string(b)
}

// URL returns a connection string for database db.
func (p *Postgres) URL(db string) string {
	u := p.AdminURL
	i := strings.Index(u, "://")
	if i < 0 {
		return u
	}
	rest := u[i+3:]
	slash := strings.Index(rest, "/")
	q := ""
	if j := strings.Index(rest, "?"); j >= 0 {
		q = rest[j:]
		if slash < 0 || slash > j {
			slash = j
		}
		rest = rest[:j]
	}
	if slash >= 0 {
		rest = rest[:slash]
	}
	return u[:i+3] + rest + "/" + db + q
}

// CreateDatabase creates database name.
func (p *Postgres) CreateDatabase(ctx context.Context, name string) error {
	conn, err := pgx.Connect(ctx, p.AdminURL)
	if err != nil {
		return fmt.Errorf("connect to %s: %w", redactURL(p.AdminURL), err)
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
	return err
}

// DropDatabase drops database name, first dropping the replication slots that
// belong to it and ending its sessions.
func (p *Postgres) DropDatabase(ctx context.Context, name string) error {
	conn, err := pgx.Connect(ctx, p.AdminURL)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	_, _ = conn.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE database = $1 AND active_pid IS NOT NULL`, name)
	_, _ = conn.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = $1 AND NOT active`, name)
	_, err = conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
	return err
}

func (p *Postgres) run(tool string, args ...string) ([]byte, error) {
	cmd := p.server.command(p.uid, p.gid, p.chownTo, tool, args...)
	// pg_ctl start leaves postgres running: give it no pipes of ours, or
	// CombinedOutput would wait for the server to exit.
	out, err := os.CreateTemp("", "pgctl-out-")
	if err != nil {
		return nil, err
	}
	defer os.Remove(out.Name())
	defer out.Close()
	cmd.Stdout, cmd.Stderr = out, out
	cmd.Dir = os.TempDir()
	runErr := cmd.Run()
	b, _ := os.ReadFile(out.Name())
	return b, runErr
}

func (p *Postgres) chown(dir string) error {
	if !p.chownTo {
		return nil
	}
	return filepath.Walk(dir, func(path string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		return os.Chown(path, p.uid, p.gid)
	})
}

// confLines renders settings as postgresql.conf lines, sorted by name.
func confLines(settings map[string]string) []byte {
	var conf bytes.Buffer
	keys := make([]string, 0, len(settings))
	for k := range settings {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(&conf, "%s = %s\n", k, settings[k])
	}
	return conf.Bytes()
}

func appendFile(name string, b []byte) error {
	f, err := os.OpenFile(name, os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// WaitFor polls cond every 20 ms until it returns true or timeout passes.
func WaitFor(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func redactURL(u string) string {
	at := strings.LastIndex(u, "@")
	scheme := strings.Index(u, "://")
	if at < 0 || scheme < 0 || at < scheme {
		return u
	}
	cred := u[scheme+3 : at]
	if c := strings.Index(cred, ":"); c >= 0 {
		return u[:scheme+3] + cred[:c] + ":xxxxx" + u[at:]
	}
	return u
}
