package config_test

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/router"
)

// repoFile returns the path of a file relative to the module root (the
// package's tests run in internal/config).
func repoFile(name string) string { return filepath.Join("..", "..", name) }

// The example configurations in testdata/ load and validate as they are.
func TestLoadExamples(t *testing.T) {
	t.Parallel()
	tests := []struct {
		file  string
		check func(t *testing.T, c config.Config)
	}{
		{"minimal.yaml", func(t *testing.T, c config.Config) {
			def := config.Default()
			if c.NATS.Stream != def.NATS.Stream || c.Postgres.Slot != def.Postgres.Slot || c.NATS.MaxInFlight != def.NATS.MaxInFlight {
				t.Errorf("minimal.yaml changed defaults: %+v", c)
			}
			if got := c.Tables(); !reflect.DeepEqual(got, []string{"public.outbox"}) {
				t.Errorf("tables = %v", got)
			}
			if want := []string{"outbox.*.*"}; !reflect.DeepEqual(c.NATS.StreamSubjects, want) {
				t.Errorf("derived stream subjects = %v, want %v", c.NATS.StreamSubjects, want)
			}
		}},
		{"full.yaml", func(t *testing.T, c config.Config) {
			// full.yaml documents the defaults: its values must be them.
			def := config.Default()
			def.Postgres.URL = c.Postgres.URL
			def.NATS.StreamSubjects = []string{"outbox.*.*"}
			if !reflect.DeepEqual(c.Postgres, def.Postgres) || !reflect.DeepEqual(c.NATS, def.NATS) ||
				c.HTTP != def.HTTP || c.Log != def.Log || c.ShutdownTimeout != def.ShutdownTimeout {
				t.Errorf("full.yaml values differ from config.Default():\n got %+v\nwant %+v", c, def)
			}
			if c.Router.DeadLetterSubject != router.DefaultDeadLetterSubject || c.Router.MaxSubjectBytes != router.DefaultMaxSubjectBytes {
				t.Errorf("router defaults: %+v", c.Router)
			}
			if got := c.Tables(); !reflect.DeepEqual(got, []string{"public.outbox"}) {
				t.Errorf("tables = %v: the messages example must not reach the publication", got)
			}
			tc := c.Router.Tables[0]
			if tc.Subject != router.DefaultSubject || tc.Columns.EventID != router.DefaultEventIDColumn || tc.Columns.Payload != router.DefaultPayloadColumn {
				t.Errorf("table defaults: %+v", tc)
			}
		}},
		{"multi-table.yaml", func(t *testing.T, c config.Config) {
			if got := c.Tables(); !reflect.DeepEqual(got, []string{"public.outbox", "billing.invoice_events"}) {
				t.Errorf("tables = %v", got)
			}
			b := c.Router.Tables[1]
			if b.AggregateType != "invoice" || b.Columns.AggregateID != "invoice_no" || b.Columns.OccurredAt != "created_at" {
				t.Errorf("billing mapping: %+v", b)
			}
			if want := map[string]string{"tenant_id": "Tenant-Id", "trace_id": "Outbox-Extra-trace_id"}; !reflect.DeepEqual(b.Headers, want) {
				t.Errorf("headers = %v, want %v", b.Headers, want)
			}
			events, dlq := c.Streams()
			if events.MaxAge != 168*time.Hour || dlq.MaxAge != 0 {
				t.Errorf("max_age: events %s, dead letters %s; want 168h and 0 (dead letters never expire)", events.MaxAge, dlq.MaxAge)
			}
			if events.Name != "EVENTS" || !reflect.DeepEqual(events.Subjects, []string{"outbox.>", "billing.>"}) ||
				dlq.Name != "EVENTS_DLQ" || !reflect.DeepEqual(dlq.Subjects, []string{"events_dlq.>"}) {
				t.Errorf("streams: %+v %+v", events, dlq)
			}
			// The derived filters are what the explicit subjects must cover.
			if got := c.Router.SubjectFilters(); !reflect.DeepEqual(got, []string{"outbox.*.*.*", "billing.invoice.*.*"}) {
				t.Errorf("subject filters = %v", got)
			}
			if _, err := router.New(c.Router); err != nil {
				t.Errorf("router.New: %v", err)
			}
		}},
		{"compose.yaml", func(t *testing.T, c config.Config) {
			if c.HTTP.Listen != "0.0.0.0:9187" {
				t.Errorf("http.listen = %q: the container's metrics port must listen on every interface", c.HTTP.Listen)
			}
			if c.NATS.URL != "nats://nats:4222" || !strings.Contains(c.Postgres.URL, "@postgres:5432/app") {
				t.Errorf("compose service names: %s %s", c.NATS.URL, c.Postgres.URL)
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.file, func(t *testing.T) {
			t.Parallel()
			path := filepath.Join("..", "..", "testdata", tc.file)
			c, err := config.Load(config.Sources{File: path, Env: envOf(nil)})
			if err != nil {
				t.Fatalf("Load(%s): %v", path, err)
			}
			if err := c.Validate(); err != nil {
				t.Fatalf("validating again: %v", err)
			}
			rc := c.Relay()
			if rc.Replication.URL == "" || !reflect.DeepEqual(rc.Replication.Tables, c.Tables()) || len(rc.Router.Messages) != len(c.Router.Messages) || rc.Stream.Name != c.NATS.Stream {
				t.Errorf("relay config: %+v", rc)
			}
			tc.check(t, c)
		})
	}
}

// yamlPaths lists the key paths of a YAML document, with list indices
// written as [] (tables[].columns.payload).
func yamlPaths(n *yaml.Node, path string, out map[string]bool) {
	switch n.Kind {
	case yaml.DocumentNode:
		for _, c := range n.Content {
			yamlPaths(c, path, out)
		}
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			p := n.Content[i].Value
			if path != "" {
				p = path + "." + p
			}
			out[p] = true
			yamlPaths(n.Content[i+1], p, out)
		}
	case yaml.SequenceNode:
		for _, c := range n.Content {
			yamlPaths(c, path+"[]", out)
		}
	}
}

// structPaths lists the YAML key paths of a struct type's fields.
func structPaths(t reflect.Type, path string, out map[string]bool) {
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		p := path + "." + name
		if path == "" {
			p = name
		}
		out[p] = true
		if f.Type.Kind() == reflect.Struct {
			structPaths(f.Type, p, out)
		}
	}
}

// full.yaml is the configuration reference: it must hold every key there is.
func TestFullExampleHasEveryKey(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile(repoFile("testdata/full.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var root yaml.Node
	if err := yaml.Unmarshal(b, &root); err != nil {
		t.Fatal(err)
	}
	documented := map[string]bool{}
	yamlPaths(&root, "", documented)

	want := map[string]bool{"tables": true, "messages": true}
	for _, path := range config.EnvKeys() {
		want[path] = true
		if i := strings.LastIndex(path, "."); i > 0 {
			want[path[:i]] = true // the section, e.g. nats
		}
	}
	structPaths(reflect.TypeOf(router.TableConfig{}), "tables[]", want)
	structPaths(reflect.TypeOf(router.MessageConfig{}), "messages[]", want)
	var missing, unknown []string
	for p := range want {
		if !documented[p] {
			missing = append(missing, p)
		}
	}
	for p := range documented {
		if !want[p] {
			unknown = append(unknown, p)
		}
	}
	sort.Strings(missing)
	sort.Strings(unknown)
	if len(missing) > 0 || len(unknown) > 0 {
		t.Fatalf("testdata/full.yaml misses keys %v and has keys %v that are not configuration keys", missing, unknown)
	}
}

// Precedence: flag > environment > file > default, for a string and an
// integer key.
func TestPrecedence(t *testing.T) {
	t.Parallel()
	const (
		fileURL = "postgres://file@db/app"
		envURL  = "postgres://env@db/app"
		flagURL = "postgres://flag@db/app"
	)
	tests := []struct {
		name                string
		file, env, flag     bool
		wantURL             string // "" = no URL anywhere: the default, which is none
		wantMaxInFlight     int
		wantURLErrorDefault bool
	}{
		{name: "default", wantMaxInFlight: 4096, wantURLErrorDefault: true},
		{name: "file", file: true, wantURL: fileURL, wantMaxInFlight: 100},
		{name: "env", env: true, wantURL: envURL, wantMaxInFlight: 200},
		{name: "flag", flag: true, wantURL: flagURL, wantMaxInFlight: 300},
		{name: "env over file", file: true, env: true, wantURL: envURL, wantMaxInFlight: 200},
		{name: "flag over file", file: true, flag: true, wantURL: flagURL, wantMaxInFlight: 300},
		{name: "flag over env", env: true, flag: true, wantURL: flagURL, wantMaxInFlight: 300},
		{name: "flag over env over file", file: true, env: true, flag: true, wantURL: flagURL, wantMaxInFlight: 300},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			doc := tbl
			if tc.file {
				doc += "postgres: {url: '" + fileURL + "'}\nnats: {max_in_flight: 100}\n"
			}
			env := map[string]string{}
			if tc.env {
				env["OUTBOX_RELAY_POSTGRES_URL"] = envURL
				env["OUTBOX_RELAY_NATS_MAX_IN_FLIGHT"] = "200"
			}
			var flags map[string]string
			if tc.flag {
				flags = map[string]string{"postgres.url": flagURL, "nats.max_in_flight": "300"}
			}
			c, err := config.Load(config.Sources{File: writeConfig(t, doc), Env: envOf(env), Flags: flags})
			if tc.wantURLErrorDefault {
				// postgres.url has no default: Load says where to set it.
				if ce := configErrors(err); len(ce) != 1 || ce[0].Path != "postgres.url" {
					t.Fatalf("Load without a URL: %v", err)
				}
			} else if err != nil {
				t.Fatal(err)
			}
			if c.Postgres.URL != tc.wantURL {
				t.Errorf("postgres.url = %q, want %q", c.Postgres.URL, tc.wantURL)
			}
			if c.NATS.MaxInFlight != tc.wantMaxInFlight {
				t.Errorf("nats.max_in_flight = %d, want %d", c.NATS.MaxInFlight, tc.wantMaxInFlight)
			}
		})
	}
}

func TestLoadEmptyAndMissingFile(t *testing.T) {
	t.Parallel()
	// An empty file is no configuration: defaults, then env.
	c, err := config.Load(config.Sources{File: writeConfig(t, "# nothing\n"), Env: envOf(map[string]string{"OUTBOX_RELAY_POSTGRES_URL": "postgres://e@db/app"})})
	if err == nil {
		t.Fatalf("no tables configured, yet Load succeeded: %+v", c)
	}
	if ce := configErrors(err); len(ce) != 1 || ce[0].Path != "tables" {
		t.Fatalf("want only the tables error, got %v", err)
	}
	_, err = config.Load(config.Sources{File: filepath.Join(t.TempDir(), "absent.yaml")})
	if err == nil || !strings.Contains(err.Error(), "absent.yaml") {
		t.Fatalf("missing file: %v", err)
	}
}

// compose is the part of docker-compose.yml the tests below read.
type compose struct {
	Services map[string]struct {
		Image       string            `yaml:"image"`
		Build       map[string]string `yaml:"build"`
		Command     yaml.Node         `yaml:"command"`
		Environment map[string]string `yaml:"environment"`
		Volumes     []string          `yaml:"volumes"`
		Ports       []string          `yaml:"ports"`
		DependsOn   map[string]struct {
			Condition string `yaml:"condition"`
		} `yaml:"depends_on"`
		Healthcheck struct {
			Test []string `yaml:"test"`
		} `yaml:"healthcheck"`
	} `yaml:"services"`
}

// interpolate applies compose's ${NAME:-default} with an empty environment.
var interpolation = regexp.MustCompile(`\$\{[A-Z_]+:-([^}]*)\}`)

// docker-compose.yml cannot run on the test machines (no Docker); check by
// reading that it is consistent with the relay's configuration.
func TestComposeFile(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile(repoFile("docker-compose.yml"))
	if err != nil {
		t.Fatal(err)
	}
	b = interpolation.ReplaceAll(b, []byte("$1"))
	var cf compose
	dec := yaml.NewDecoder(strings.NewReader(string(b)))
	if err := dec.Decode(&cf); err != nil {
		t.Fatalf("docker-compose.yml: %v", err)
	}
	pg, nats, relay := cf.Services["postgres"], cf.Services["nats"], cf.Services["relay"]

	// postgres: version, logical decoding, healthcheck, init scripts.
	if pg.Image != "postgres:16" {
		t.Errorf("postgres image %q", pg.Image)
	}
	for _, arg := range []string{"wal_level=logical", "max_replication_slots=10", "max_wal_senders=10", "max_slot_wal_keep_size=10GB"} {
		if !strings.Contains(pg.Command.Value, "-c "+arg) {
			t.Errorf("postgres command %q lacks -c %s", pg.Command.Value, arg)
		}
	}
	if len(pg.Healthcheck.Test) == 0 {
		t.Error("postgres has no healthcheck")
	}
	var inits []string
	for _, v := range pg.Volumes {
		parts := strings.Split(v, ":")
		if strings.HasPrefix(parts[0], "./") {
			if _, err := os.Stat(repoFile(parts[0])); err != nil {
				t.Errorf("postgres mounts a missing file: %v", err)
			}
		}
		if len(parts) > 1 && strings.HasPrefix(parts[1], "/docker-entrypoint-initdb.d/") {
			inits = append(inits, filepath.Base(parts[1])+"="+parts[0])
		}
	}
	// The entrypoint runs them in name order: the table, then its
	// publication, then the role that is granted SELECT on the table.
	if !sort.StringsAreSorted(inits) || !reflect.DeepEqual(inits, []string{
		"10-outbox.sql=./sql/outbox.sql", "20-publication.sql=./sql/publication.sql", "30-relay-role.sql=./testdata/compose-relay-role.sql",
	}) {
		t.Errorf("postgres init scripts %v", inits)
	}

	// nats: JetStream with a file store, 2.10 or later.
	if m := regexp.MustCompile(`^nats:2\.(\d+)`).FindStringSubmatch(nats.Image); m == nil {
		t.Errorf("nats image %q", nats.Image)
	} else if minor, _ := strconv.Atoi(m[1]); minor < 10 {
		t.Errorf("nats image %q: want 2.10 or later", nats.Image)
	}
	var natsArgs []string
	if err := nats.Command.Decode(&natsArgs); err != nil {
		t.Fatal(err)
	}
	if cmd := strings.Join(natsArgs, " "); !strings.Contains(cmd, "-js") || !strings.Contains(cmd, "-sd /data") {
		t.Errorf("nats command %q", cmd)
	}

	// relay: built here, configured by testdata/compose.yaml plus env vars
	// the relay actually reads, started after healthy dependencies.
	if relay.Build["context"] != "." || relay.Build["dockerfile"] != "Dockerfile" {
		t.Errorf("relay build %v", relay.Build)
	}
	var configFile string
	for _, v := range relay.Volumes {
		if host, ctr, _ := strings.Cut(v, ":"); strings.HasPrefix(ctr, "/etc/outbox-relay/config.yaml") {
			configFile = host
		}
	}
	if configFile != "./testdata/compose.yaml" {
		t.Errorf("relay config mount %q", configFile)
	}
	keys := config.EnvKeys()
	for k := range relay.Environment {
		if _, ok := keys[k]; !ok && k != config.ConfigFileEnv {
			t.Errorf("relay environment variable %s is not one the relay reads", k)
		}
	}
	for _, dep := range []string{"postgres", "nats"} {
		if relay.DependsOn[dep].Condition != "service_healthy" {
			t.Errorf("relay depends_on %s: %+v", dep, relay.DependsOn[dep])
		}
	}
	c, err := config.Load(config.Sources{File: repoFile(configFile), Env: envOf(relay.Environment)})
	if err != nil {
		t.Fatalf("the relay's configuration in compose: %v", err)
	}
	if c.Postgres.URL != relay.Environment["OUTBOX_RELAY_POSTGRES_URL"] || c.NATS.URL != relay.Environment["OUTBOX_RELAY_NATS_URL"] {
		t.Errorf("environment did not override the file: %s %s", c.Postgres.URL, c.NATS.URL)
	}
	_, port, _ := net.SplitHostPort(c.HTTP.Listen)
	published := false
	for _, p := range relay.Ports {
		published = published || strings.HasSuffix(p, ":"+port+":"+port)
	}
	if port != "9187" || !published {
		t.Errorf("metrics port: http.listen %q, ports %v", c.HTTP.Listen, relay.Ports)
	}
	// The role and database in the URL are those compose creates.
	if !strings.Contains(c.Postgres.URL, "outbox_relay:") || !strings.HasSuffix(strings.Split(c.Postgres.URL, "?")[0], "@postgres:5432/app") {
		t.Errorf("relay postgres URL %q", c.Postgres.URL)
	}

	// The Dockerfile builds that binary, statically, and runs it unprivileged
	// with the mounted configuration.
	df, err := os.ReadFile(repoFile("Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"FROM golang:1.26 AS build", "CGO_ENABLED=0", "./cmd/outbox-relay", "USER nonroot", `"run", "--config", "/etc/outbox-relay/config.yaml"`} {
		if !strings.Contains(string(df), want) {
			t.Errorf("Dockerfile lacks %q", want)
		}
	}
}

// TestLoadUnknownEnvironment: an OUTBOX_RELAY_* variable that is no key is
// an error when it is a typo of one (it would be ignored without a word
// otherwise) and a warning when it is anything else.
func TestLoadUnknownEnvironment(t *testing.T) {
	t.Parallel()
	file := writeConfig(t, "postgres: {url: postgres://relay@db/app}\nnats: {url: nats://127.0.0.1:4222}\ntables: [{table: outbox}]\n")
	for _, tc := range []struct {
		name     string
		environ  []string
		wantErr  string // substring; empty: Load succeeds
		warnings int
	}{
		{"known keys and the file variable", []string{"OUTBOX_RELAY_NATS_MAX_IN_FLIGHT=8", config.ConfigFileEnv + "=/x.yaml", "PATH=/bin"}, "", 0},
		{"typo", []string{"OUTBOX_RELAY_NATS_MAX_INFLIGHT=8"}, "OUTBOX_RELAY_NATS_MAX_INFLIGHT is not a configuration key: did you mean OUTBOX_RELAY_NATS_MAX_IN_FLIGHT?", 0},
		{"transposed letters", []string{"OUTBOX_RELAY_POSTGERS_URL=postgres://x@y/z"}, "did you mean OUTBOX_RELAY_POSTGRES_URL?", 0},
		{"another program's variable", []string{"OUTBOX_RELAY_PASSWORD=secret"}, "", 1},
		{"other prefixes are not ours", []string{"OUTBOX_RELAYNATS_URL=x", "OUTBOX_TEST_NATS_URL=x"}, "", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := map[string]string{}
			for _, kv := range tc.environ {
				k, v, _ := strings.Cut(kv, "=")
				env[k] = v
			}
			c, err := config.Load(config.Sources{File: file, Env: envOf(env), Environ: tc.environ})
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) || !errors.Is(err, config.ErrInvalid) {
					t.Fatalf("want an error containing %q, got %v", tc.wantErr, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(c.Warnings) != tc.warnings {
				t.Fatalf("warnings %q, want %d", c.Warnings, tc.warnings)
			}
			for _, w := range c.Warnings {
				if strings.Contains(w, "secret") {
					t.Fatalf("a warning shows the value: %q", w)
				}
			}
		})
	}
}

// Issue 27: two typos took two runs (nats.max_inflight, then
// tables[0].colums). Every unknown key is reported at once, each with its
// did-you-mean.
func TestLoadReportsEveryUnknownKey(t *testing.T) {
	t.Parallel()
	file := writeConfig(t, `postgres:
  url: postgres://relay@db/app
nats:
  max_inflight: 100
tables:
  - table: public.outbox
    colums:
      event_id: id
  - table: public.other
    subjetc: "x.{aggregate_id}"
`)
	_, err := config.Load(config.Sources{File: file})
	want := map[string]string{
		"nats.max_inflight": "did you mean max_in_flight?",
		"tables[0].colums":  "did you mean columns?",
		"tables[1].subjetc": "did you mean subject?",
	}
	got := map[string]string{}
	for _, ce := range configErrors(err) {
		got[ce.Path] = ce.Msg
	}
	for path, hint := range want {
		if !strings.Contains(got[path], hint) {
			t.Errorf("%s: got %q, want %q among all errors:\n%v", path, got[path], hint, err)
		}
	}
}
