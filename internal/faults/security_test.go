package faults

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// secureHBA lets the harness's superuser in without TLS (it sets up
// databases) and requires TLS and a password from every other role.
const secureHBA = `local all all trust
local replication all trust
host all postgres 127.0.0.1/32 trust
host replication postgres 127.0.0.1/32 trust
hostssl all all 127.0.0.1/32 scram-sha-256
hostssl replication all 127.0.0.1/32 scram-sha-256
hostnossl all all 127.0.0.1/32 reject
hostnossl replication all 127.0.0.1/32 reject
`

// securePG returns the package's PostgreSQL cluster that serves TLS with
// generated certificates and requires scram-sha-256 over TLS for every
// role but the harness's superuser.
func securePG(t *testing.T) (*testenv.Postgres, *testenv.Certs) {
	t.Helper()
	testenv.Get(t) // skips under -short
	secure.once.Do(func() {
		dir, err := os.MkdirTemp("", "outbox-relay-certs-")
		if err != nil {
			secure.err = err
			return
		}
		secure.dir = dir
		c, err := testenv.NewCerts(dir)
		if err != nil {
			secure.err = err
			return
		}
		pg, err := testenv.StartPostgres(c.PostgresTLS()...)
		if err != nil {
			secure.err = err
			return
		}
		if err := pg.SetHBA(secureHBA); err != nil {
			pg.Close()
			secure.err = err
			return
		}
		secure.pg, secure.certs = pg, c
	})
	if secure.err != nil {
		t.Fatalf("secure PostgreSQL: %v", secure.err)
	}
	return secure.pg, secure.certs
}

// secret returns a distinctive random password.
func secret(prefix string) string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return prefix + "-S3cr3t-" + hex.EncodeToString(b[:])
}

// createRole creates a LOGIN REPLICATION role with a password that may read
// the scenario's outbox table, and drops it when the test ends.
func (s *scenario) createRole(ctx context.Context, password string) string {
	s.t.Helper()
	role := testenv.UniqueName("relay")
	c := s.adminConn(ctx)
	for _, q := range []string{
		fmt.Sprintf("CREATE ROLE %s WITH LOGIN REPLICATION PASSWORD %s", role, quoteLiteral(password)),
		fmt.Sprintf("GRANT SELECT ON public.outbox TO %s", role),
	} {
		if _, err := c.Exec(ctx, q); err != nil {
			s.t.Fatalf("%s: %v", q, err)
		}
	}
	s.t.Cleanup(func() {
		ctx := context.Background()
		if c, err := pgx.Connect(ctx, s.pg.URL(s.db.Name)); err == nil {
			_, _ = c.Exec(ctx, "DROP OWNED BY "+role)
			c.Close(ctx)
		}
		if c, err := pgx.Connect(ctx, s.pg.AdminURL); err == nil {
			_, _ = c.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role)
			_, _ = c.Exec(ctx, "DROP ROLE IF EXISTS "+role)
			c.Close(ctx)
		}
	})
	return role
}

func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// tlsURL is the relay's URL for role on the secure cluster: TLS with the
// server's certificate and host name verified against the test CA.
func tlsURL(pg *testenv.Postgres, db, role, password, caFile string) string {
	u := &url.URL{Scheme: "postgres", User: url.UserPassword(role, password), Host: fmt.Sprintf("127.0.0.1:%d", pg.Port()), Path: "/" + db}
	u.RawQuery = "sslmode=verify-full&sslrootcert=" + url.QueryEscape(caFile)
	return u.String()
}

// relayEvents writes n events while a relay runs and checks they all
// arrive in order.
func (s *scenario) relayEvents(n int, fault string) {
	s.t.Helper()
	startLoad(s.t, s.db.Pool, loadSpec{Writers: 2, Aggregates: 10, Events: n}).wait()
	s.waitCount(s.stream, uint64(n), 60*time.Second)
	o := s.verify(30 * time.Second)
	s.mustHold(fault, o, 0, "")
}

// The relay streams over TLS with sslmode=verify-full (server certificate
// and host name checked against a CA), and refuses a server whose
// certificate its CA did not sign.
func TestPostgresTLSVerifyFull(t *testing.T) {
	t.Parallel()
	pg, certs := securePG(t)
	s := newScenario(t, pg, testenv.Get(t).NATS.URL)
	ctx := context.Background()
	pw := secret("pg")
	role := s.createRole(ctx, pw)
	s.set("postgres.url", tlsURL(pg, s.db.Name, role, pw, certs.CAFile))
	r := s.startRelay()
	s.waitSlotActive(30 * time.Second)
	var ssl bool
	var version string
	err := s.db.Pool.QueryRow(ctx, `SELECT s.ssl, s.version FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
		WHERE a.usename = $1 AND a.backend_type = 'walsender'`, role).Scan(&ssl, &version)
	if err != nil || !ssl {
		t.Fatalf("the relay's replication connection: ssl %v (%s), %v", ssl, version, err)
	}
	s.logf("replication connection over %s", version)
	s.relayEvents(200, "postgres TLS verify-full")
	if strings.Contains(r.output(), pw) {
		t.Error("the relay's output holds the PostgreSQL password")
	}

	// A CA that did not sign the server's certificate: refused.
	other, err := testenv.NewCerts(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	r.kill()
	s.set("postgres.url", tlsURL(pg, s.db.Name, role, pw, other.CAFile))
	out, code := s.runCmd(60*time.Second, nil, "run", "--config", s.writeConfig())
	if code == 0 || !strings.Contains(out, "certificate") {
		t.Fatalf("run against an untrusted server certificate exited %d, want an error about the certificate:\n%s", code, out)
	}
	if strings.Contains(out, pw) {
		t.Errorf("the error output holds the PostgreSQL password:\n%s", out)
	}
}

// natsAuthCase is one way the relay authenticates to NATS.
type natsAuthCase struct {
	name string
	// server returns the server options; relay sets the relay's nats.*
	// keys; client the test's own connection options.
	setup func(t *testing.T, dir string, c *testenv.Certs) (server []testenv.NATSOption, relay map[string]any, client []nats.Option, secrets []string)
}

func natsAuthCases() []natsAuthCase {
	return []natsAuthCase{
		{"TLS", func(t *testing.T, dir string, c *testenv.Certs) ([]testenv.NATSOption, map[string]any, []nats.Option, []string) {
			o, err := testenv.WithNATSTLS(c, false)
			if err != nil {
				t.Fatal(err)
			}
			return []testenv.NATSOption{o}, map[string]any{"ca_file": c.CAFile}, []nats.Option{nats.RootCAs(c.CAFile)}, nil
		}},
		{"mutual TLS", func(t *testing.T, dir string, c *testenv.Certs) ([]testenv.NATSOption, map[string]any, []nats.Option, []string) {
			o, err := testenv.WithNATSTLS(c, true)
			if err != nil {
				t.Fatal(err)
			}
			return []testenv.NATSOption{o}, map[string]any{"ca_file": c.CAFile, "cert_file": c.ClientCert, "key_file": c.ClientKey},
				[]nats.Option{nats.RootCAs(c.CAFile), nats.ClientCert(c.ClientCert, c.ClientKey)}, nil
		}},
		{"user and password", func(t *testing.T, dir string, c *testenv.Certs) ([]testenv.NATSOption, map[string]any, []nats.Option, []string) {
			pw := secret("nats")
			o, err := testenv.WithNATSConfig(fmt.Sprintf("authorization { users = [ { user: relay, password: %q } ] }", pw))
			if err != nil {
				t.Fatal(err)
			}
			return []testenv.NATSOption{o}, map[string]any{"user": "relay", "password": pw}, []nats.Option{nats.UserInfo("relay", pw)}, []string{pw}
		}},
		{"NKey", func(t *testing.T, dir string, c *testenv.Certs) ([]testenv.NATSOption, map[string]any, []nats.Option, []string) {
			u, err := testenv.NewNKeyUser(dir, "relay")
			if err != nil {
				t.Fatal(err)
			}
			o, err := testenv.WithNATSConfig(fmt.Sprintf("authorization { users = [ { nkey: %q } ] }", u.Public))
			if err != nil {
				t.Fatal(err)
			}
			opt, err := nats.NkeyOptionFromSeed(u.SeedFile)
			if err != nil {
				t.Fatal(err)
			}
			seed, _ := os.ReadFile(u.SeedFile)
			return []testenv.NATSOption{o}, map[string]any{"nkey_seed_file": u.SeedFile}, []nats.Option{opt}, []string{strings.TrimSpace(string(seed))}
		}},
		{"creds (JWT)", func(t *testing.T, dir string, c *testenv.Certs) ([]testenv.NATSOption, map[string]any, []nats.Option, []string) {
			a, err := testenv.NewOperatorAuth(dir)
			if err != nil {
				t.Fatal(err)
			}
			o, err := testenv.WithNATSConfig(a.Config)
			if err != nil {
				t.Fatal(err)
			}
			return []testenv.NATSOption{o}, map[string]any{"credentials_file": a.CredsFile}, []nats.Option{nats.UserCredentials(a.CredsFile)}, []string{a.UserSeed}
		}},
	}
}

// The relay authenticates to NATS in each supported way and relays
// through it; no key or password shows in its output.
func TestNATSAuthentication(t *testing.T) {
	t.Parallel()
	certDir := t.TempDir()
	certs, err := testenv.NewCerts(certDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range natsAuthCases() {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			server, relayKeys, client, secrets := tc.setup(t, dir, certs)
			ns, err := testenv.StartNATS(server...)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(ns.Close)
			s := newScenario(t, testenv.Get(t).PG, ns.URL, client...)
			for k, v := range relayKeys {
				s.set("nats."+k, v)
			}
			r := s.startRelay()
			s.relayEvents(200, "nats auth: "+tc.name)
			for _, sec := range secrets {
				if strings.Contains(r.output(), sec) {
					t.Errorf("the relay's output holds a secret (%s...)", sec[:6])
				}
			}
		})
	}
}

// Passwords in the PostgreSQL and NATS URLs and in nats.password never
// appear in logs (debug level), `status` output, error messages or
// metrics — in normal operation and in every failure that reports a
// connection problem.
func TestSecretsNeverLeak(t *testing.T) {
	t.Parallel()
	pg, certs := securePG(t)
	pgPW, natsURLPW, natsPW := secret("pg"), secret("natsurl"), secret("natspw")
	conf := fmt.Sprintf(`authorization { users = [ { user: relay1, password: %q }, { user: relay2, password: %q } ] }`, natsURLPW, natsPW)
	opt, err := testenv.WithNATSConfig(conf)
	if err != nil {
		t.Fatal(err)
	}
	ns, err := testenv.StartNATS(opt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ns.Close)
	s := newScenario(t, pg, ns.URL, nats.UserInfo("relay2", natsPW))
	ctx := context.Background()
	role := s.createRole(ctx, pgPW)
	hostPort := strings.TrimPrefix(ns.URL, "nats://")
	s.set("postgres.url", tlsURL(pg, s.db.Name, role, pgPW, certs.CAFile))
	s.set("nats.url", fmt.Sprintf("nats://relay1:%s@%s", natsURLPW, hostPort))
	s.set("log.level", "debug")
	port, err := testenv.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	s.set("http.listen", fmt.Sprintf("127.0.0.1:%d", port))
	secrets := []string{pgPW, natsURLPW, natsPW}
	var outputs []string
	collect := func(what, out string) {
		outputs = append(outputs, "== "+what+" ==\n"+out)
	}

	// Normal operation, with credentials in the URLs.
	out, code := s.runCmd(60*time.Second, nil, "setup", "--config", s.writeConfig())
	collect("setup", out)
	if code != 0 {
		t.Fatalf("setup exited %d:\n%s", code, out)
	}
	r := s.startRelay()
	startLoad(t, s.db.Pool, loadSpec{Writers: 1, Aggregates: 10, Events: 100}).wait()
	s.waitCount(s.stream, 100, 60*time.Second)
	metrics := scrape(t, fmt.Sprintf("http://127.0.0.1:%d/metrics", port))
	collect("metrics", metrics)
	for _, args := range [][]string{{"status"}, {"status", "--json"}} {
		out, code := s.runCmd(60*time.Second, nil, append(args, "--config", s.writeConfig())...)
		collect(strings.Join(args, " "), out)
		if code != 0 {
			t.Errorf("%v exited %d:\n%s", args, code, out)
		}
	}
	if err := r.term(10 * time.Second); err != nil {
		t.Errorf("relay stop: %v", err)
	}
	collect("run", r.output())

	// nats.user and nats.password instead of the URL.
	s.set("nats.url", ns.URL)
	s.set("nats.user", "relay2")
	s.set("nats.password", natsPW)
	out, _ = s.runCmd(60*time.Second, nil, "status", "--config", s.writeConfig())
	collect("status (nats.password)", out)

	// Failures that report connection problems, each with a password in
	// play: wrong PostgreSQL password, wrong NATS password (URL and
	// field), unreachable PostgreSQL, invalid URLs from the environment.
	wrongPG, wrongNATS, wrongField := secret("wrongpg"), secret("wrongnats"), secret("wrongfield")
	secrets = append(secrets, wrongPG, wrongNATS, wrongField)
	s.set("postgres.url", tlsURL(pg, s.db.Name, role, wrongPG, certs.CAFile))
	out, code = s.runCmd(60*time.Second, nil, "run", "--config", s.writeConfig())
	collect("run, wrong postgres password", out)
	if code == 0 || !strings.Contains(strings.ToLower(out), "password") {
		t.Errorf("run with a wrong PostgreSQL password exited %d without saying so:\n%s", code, out)
	}
	s.set("postgres.url", tlsURL(pg, s.db.Name, role, pgPW, certs.CAFile))
	s.set("nats.password", wrongField)
	out, code = s.runCmd(60*time.Second, nil, "status", "--config", s.writeConfig())
	collect("status, wrong nats.password", out)
	if code == 0 {
		t.Errorf("status with a wrong NATS password exited 0:\n%s", out)
	}
	s.unset("nats.user")
	s.unset("nats.password")
	s.set("nats.url", fmt.Sprintf("nats://relay1:%s@%s", wrongNATS, hostPort))
	out, _ = s.runCmd(60*time.Second, nil, "status", "--config", s.writeConfig())
	collect("status, wrong password in nats.url", out)
	s.set("nats.url", fmt.Sprintf("nats://relay1:%s@%s", natsURLPW, hostPort))
	closed, err := testenv.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	s.set("postgres.url", strings.Replace(tlsURL(pg, s.db.Name, role, pgPW, certs.CAFile), fmt.Sprintf(":%d/", pg.Port()), fmt.Sprintf(":%d/", closed), 1))
	out, _ = s.runCmd(60*time.Second, nil, "status", "--config", s.writeConfig())
	collect("status, postgres unreachable", out)
	// run waits for an unreachable server (README, "A server that is down
	// at start is waited for"): collect what it logs while it waits.
	r = s.startCmd(nil, "run", "--config", s.writeConfig())
	if _, ok := r.waitLog(r.started, 60*time.Second, func(e logEntry) bool { return e.Msg == "postgres unreachable at start; retrying" }); !ok {
		t.Errorf("run with PostgreSQL unreachable did not say it waits for it:\n%s", r.output())
	}
	if err := r.term(30 * time.Second); err != nil {
		t.Errorf("run waiting for PostgreSQL did not stop on SIGTERM: %v", err)
	}
	collect("run, postgres unreachable", r.output())
	badEnv := []string{
		"OUTBOX_RELAY_POSTGRES_URL=postgres://" + role + ":" + pgPW + "@/nohost",
		"OUTBOX_RELAY_NATS_URL=nats://relay1:" + natsURLPW + "@[::1",
	}
	out, code = s.runCmd(60*time.Second, badEnv, "status", "--config", s.writeConfig())
	collect("status, invalid URLs from the environment", out)
	if code == 0 {
		t.Errorf("invalid URLs were accepted:\n%s", out)
	}

	all := strings.Join(outputs, "\n")
	for _, sec := range secrets {
		for _, form := range []string{sec, url.QueryEscape(sec), url.PathEscape(sec)} {
			if strings.Contains(all, form) {
				for _, o := range outputs {
					if strings.Contains(o, form) {
						t.Errorf("a secret (%s...) appears in:\n%s", sec[:10], o)
					}
				}
			}
		}
	}
	if t.Failed() {
		return
	}
	s.logf("no secret in %d outputs (%d bytes): setup, run (debug logs), metrics, status, status --json and 6 failures", len(outputs), len(all))
	record(faultRow{Fault: "secrets in logs, status, errors, metrics", Note: fmt.Sprintf("%d outputs clean", len(outputs))})
}

func scrape(t *testing.T, u string) string {
	t.Helper()
	var body string
	if !testenv.WaitFor(30*time.Second, func() bool {
		resp, err := http.Get(u)
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		body = string(b)
		return resp.StatusCode == http.StatusOK
	}) {
		t.Fatalf("GET %s failed", u)
	}
	return body
}

// testdata reads a file of the package's testdata directory.
func testdata(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// The least-privilege grants and NATS authorization block that
// docs/faults.md documents, exercised verbatim: setup runs once as the
// table owner and a NATS admin; the relay then runs (and `status` works)
// as a PostgreSQL role with only LOGIN, REPLICATION and SELECT on the
// outbox table, and a NATS user that may publish only the outbox and
// dead-letter subjects and the JetStream API calls the relay makes.
func TestLeastPrivilege(t *testing.T) {
	t.Parallel()
	pg, certs := securePG(t)
	adminPW, relayPW := secret("admin"), secret("relay")
	natsConf := fmt.Sprintf("OUTBOX_ADMIN_PASSWORD: %q\nOUTBOX_RELAY_PASSWORD: %q\n", adminPW, relayPW) + testdata(t, "nats-authorization.conf")
	opt, err := testenv.WithNATSConfig(natsConf)
	if err != nil {
		t.Fatal(err)
	}
	ns, err := testenv.StartNATS(opt)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ns.Close)
	s := newScenario(t, pg, ns.URL, nats.UserInfo("outbox_admin", adminPW))
	ctx := context.Background()

	// The documented path, with a table owner that is no superuser and has
	// no REPLICATION, owning the service's database, as a new user sets it
	// up: part 1 (the relay's role) as a role that may create roles, part
	// 2 (grants, publication, backfill record) as the owner, then `setup`
	// as the relay's role with a NATS user that may create streams.
	owner := strings.ToLower(testenv.UniqueName("app_owner"))
	ownerPW := secret("owner")
	c := s.adminConn(ctx)
	for _, q := range []string{
		"CREATE ROLE " + owner + " WITH LOGIN PASSWORD " + quoteLiteral(ownerPW),
		"ALTER DATABASE " + pgx.Identifier{s.db.Name}.Sanitize() + " OWNER TO " + owner,
		"ALTER TABLE public.outbox OWNER TO " + owner,
	} {
		if _, err := c.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	if _, err := c.PgConn().Exec(ctx, repoSQL(t, "least-privilege-role.sql")).ReadAll(); err != nil {
		t.Fatalf("least-privilege-role.sql: %v", err)
	}
	t.Cleanup(func() {
		ctx := context.Background()
		if c, err := pgx.Connect(ctx, s.pg.URL(s.db.Name)); err == nil {
			_, _ = c.Exec(ctx, "DROP OWNED BY outbox_relay, "+owner)
			c.Close(ctx)
		}
		if c, err := pgx.Connect(ctx, s.pg.AdminURL); err == nil {
			_, _ = c.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename IN ('outbox_relay', $1)", owner)
			_, _ = c.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{s.db.Name}.Sanitize()+" WITH (FORCE)")
			_, _ = c.Exec(ctx, "DROP ROLE IF EXISTS outbox_relay")
			_, _ = c.Exec(ctx, "DROP ROLE IF EXISTS "+owner)
			c.Close(ctx)
		}
	})
	if _, err := c.Exec(ctx, "ALTER ROLE outbox_relay PASSWORD "+quoteLiteral(relayPW)); err != nil {
		t.Fatal(err)
	}

	// The relay's configuration: defaults (slot and publication
	// outbox_relay, stream OUTBOX, subjects outbox.>, dead letters
	// outbox_dlq.> in OUTBOX_DLQ), as the authorization block assumes.
	relayURL := tlsURL(pg, s.db.Name, "outbox_relay", relayPW, certs.CAFile)
	s.cfg = map[string]any{
		"postgres": map[string]any{"url": relayURL, "status_interval": "200ms"},
		"nats":     map[string]any{"url": ns.URL, "user": "outbox_relay", "password": relayPW, "create_streams": false},
		"tables":   []any{map[string]any{"table": "public.outbox"}},
		"http":     map[string]any{"listen": ""},
	}
	s.name, s.stream, s.dlq = "outbox_relay", "OUTBOX", "OUTBOX_DLQ"
	natsAdmin := []string{"OUTBOX_RELAY_NATS_USER=outbox_admin", "OUTBOX_RELAY_NATS_PASSWORD=" + adminPW, "OUTBOX_RELAY_NATS_CREATE_STREAMS=true"}

	// Before the owner's part, setup as the relay's role is refused with
	// the fix named (it said only "permission denied for database").
	out, code := s.runCmd(60*time.Second, natsAdmin, "setup", "--config", s.writeConfig())
	if code == 0 || !strings.Contains(out, `Least privilege: PostgreSQL`) {
		t.Fatalf("setup as outbox_relay before the owner's grants exited %d without naming the owner's statements:\n%s", code, out)
	}
	s.logf("setup as outbox_relay before the owner's part: %s", lastLine(out))
	out, code = s.runCmd(60*time.Second, append([]string{"OUTBOX_RELAY_POSTGRES_BACKFILL=false"}, natsAdmin...), "setup", "--config", s.writeConfig())
	if code == 0 || !strings.Contains(out, "as the owner run sql/publication.sql") {
		t.Fatalf("setup without backfill as outbox_relay before the owner's grants exited %d without naming sql/publication.sql:\n%s", code, out)
	}
	// The owner cannot run setup (no REPLICATION): the docs do not ask it to.
	ownerURL := tlsURL(pg, s.db.Name, owner, ownerPW, certs.CAFile)
	oc, err := pgx.Connect(ctx, ownerURL)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := oc.PgConn().Exec(ctx, repoSQL(t, "least-privilege-owner.sql")).ReadAll(); err != nil {
		t.Fatalf("least-privilege-owner.sql as %s: %v", owner, err)
	}
	oc.Close(ctx)
	out, code = s.runCmd(60*time.Second, natsAdmin, "setup", "--config", s.writeConfig())
	if code != 0 {
		t.Fatalf("setup as outbox_relay after the owner's part exited %d:\n%s", code, out)
	}
	s.logf("setup as outbox_relay:\n%s", out)

	s.sample()
	r := s.startRelay()
	startLoad(t, s.db.Pool, loadSpec{Writers: 2, Aggregates: 20, Events: 300}).wait()
	// A row whose subject would be too long is dead-lettered: the relay's
	// user publishes to outbox_dlq.> too.
	dead := s.insertEvents(ctx, [4]any{"registration", strings.Repeat("a", 1100), 1, `{}`})
	s.waitCount(s.stream, 300, 60*time.Second)
	s.waitCount(s.dlq, 1, 60*time.Second)
	out, code = s.runCmd(60*time.Second, nil, "status", "--config", s.writeConfig())
	if code != 0 {
		t.Errorf("status with the relay's credentials exited %d:\n%s", code, out)
	}
	if strings.Contains(r.output(), "Permissions Violation") || strings.Contains(r.output(), "permission denied") {
		t.Errorf("the relay hit a permission it was not granted:\n%s", r.output())
	}
	o := s.verify(30*time.Second, dead...)
	checkDeadLetter(t, o, dead[0], "subject_too_long")
	s.mustHold("least privilege (PostgreSQL grants, NATS authorization)", o, 0, "sql/least-privilege-role.sql, sql/least-privilege-owner.sql, testdata/nats-authorization.conf")

	// The grants are really that narrow.
	rc, err := pgx.Connect(ctx, relayURL)
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close(ctx)
	if _, err := rc.Exec(ctx, "INSERT INTO outbox (event_id, aggregate_id, aggregate_version, event_type, payload) VALUES (gen_random_uuid(), 'x', 1, 'T', '{}')"); err == nil {
		t.Error("outbox_relay may insert into the outbox")
	}
	nc, err := nats.Connect(ns.URL, nats.UserInfo("outbox_relay", relayPW))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	if _, err := js.CreateStream(cctx, jetstream.StreamConfig{Name: "ROGUE", Subjects: []string{"rogue.>"}}); err == nil {
		t.Error("the relay's NATS user may create streams")
	}
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

// repoSQL reads a file of the repository's sql/ folder.
func repoSQL(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(testenv.RepoRoot(t), "sql", name))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// docs/faults.md shows the grants and the authorization block the tests
// exercise, verbatim.
func TestDocsShowExercisedGrants(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile(filepath.Join(testenv.RepoRoot(t), "docs", "faults.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"least-privilege-role.sql", "least-privilege-owner.sql"} {
		if !strings.Contains(string(doc), strings.TrimSpace(repoSQL(t, f))) {
			t.Errorf("docs/faults.md does not contain sql/%s verbatim", f)
		}
	}
	if !strings.Contains(string(doc), strings.TrimSpace(testdata(t, "nats-authorization.conf"))) {
		t.Errorf("docs/faults.md does not contain testdata/nats-authorization.conf verbatim")
	}
}
