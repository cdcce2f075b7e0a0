package config_test

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/config"
)

// Building blocks of the YAML documents below: a valid postgres section and
// a valid tables list.
const (
	pg  = "postgres: {url: postgres://relay@db:5432/app}\n"
	tbl = "tables: [{table: public.outbox}]\n"
)

// writeConfig writes a YAML document to a file of the test's own.
func writeConfig(t *testing.T, doc string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "relay.yaml")
	if err := os.WriteFile(path, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// envOf returns a lookup function over a fixed environment, in place of
// os.LookupEnv.
func envOf(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) {
		v, ok := m[k]
		return v, ok
	}
}

// configErrors returns every *config.Error in err's tree (Validate joins one
// per problem).
func configErrors(err error) []*config.Error {
	var out []*config.Error
	var walk func(error)
	walk = func(e error) {
		if e == nil {
			return
		}
		if ce, ok := e.(*config.Error); ok {
			out = append(out, ce)
			return
		}
		switch u := e.(type) {
		case interface{ Unwrap() []error }:
			for _, x := range u.Unwrap() {
				walk(x)
			}
		case interface{ Unwrap() error }:
			walk(u.Unwrap())
		}
	}
	walk(err)
	return out
}

func TestLoadRejectsInvalidConfig(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		doc   string            // YAML file; empty for none
		env   map[string]string // environment variables
		flags map[string]string // flags the user set
		path  string            // the key the error must name
		hint  string            // part of the fix the message must suggest
	}{
		// postgres.url
		{name: "missing postgres url", doc: tbl,
			path: "postgres.url", hint: "OUTBOX_RELAY_POSTGRES_URL"},
		{name: "postgres url without host", doc: "postgres: {url: 'postgres:///app'}\n" + tbl,
			path: "postgres.url", hint: "postgres://user@host:5432/dbname"},
		{name: "postgres url without database", doc: "postgres: {url: 'postgres://relay@db:5432'}\n" + tbl,
			path: "postgres.url", hint: "names no database"},
		{name: "postgres url without scheme", doc: "postgres: {url: 'db:5432/app'}\n" + tbl,
			path: "postgres.url", hint: "neither a postgres:// URL nor a key=value"},
		{name: "postgres url with unescaped password", doc: "postgres: {url: 'postgres://relay:pa ss@db:5432/app'}\n" + tbl,
			path: "postgres.url", hint: "percent-encode"},
		{name: "postgres url as a list", doc: "postgres: {url: [a, b]}\n" + tbl,
			path: "postgres.url", hint: "expected a single value"},
		// nats.url
		{name: "nats url with http scheme", doc: pg + tbl + "nats: {url: 'http://nats:4222'}\n",
			path: "nats.url", hint: "use nats://, tls://, ws:// or wss://"},
		{name: "nats url without scheme", doc: pg + tbl + "nats: {url: '127.0.0.1:4222'}\n",
			path: "nats.url", hint: "use nats://host:4222"},
		{name: "second nats url bad", doc: pg + tbl + "nats: {url: 'nats://a:4222, https://b:4222'}\n",
			path: "nats.url", hint: "scheme \"https\""},
		{name: "empty nats url from env", doc: pg + tbl, env: map[string]string{"OUTBOX_RELAY_NATS_URL": ""},
			path: "nats.url", hint: "is required"},
		// Unknown keys, shapes and scalar types.
		{name: "unknown top-level key", doc: pg + tbl + "postgress: {slot: x}\n",
			path: "postgress", hint: "unknown key: did you mean postgres? (known keys here: dead_letter_subject, http, log,"},
		{name: "unknown nested key in a table", doc: pg + "tables:\n  - table: public.outbox\n    colums: {event_id: id}\n",
			path: "tables[0].colums", hint: "did you mean columns? (known keys here: aggregate_type, cloudevents, columns, headers, subject, table"},
		{name: "unknown column key", doc: pg + "tables: [{table: public.outbox, columns: {eventid: id}}]\n",
			path: "tables[0].columns.eventid", hint: "event_id"},
		{name: "unknown nats key", doc: pg + tbl + "nats: {max_inflight: 10}\n",
			path: "nats.max_inflight", hint: "max_in_flight"},
		{name: "unknown flag key", doc: pg + tbl, flags: map[string]string{"postgres.uri": "x"},
			path: "postgres.uri", hint: "is not a configuration key"},
		{name: "key given twice", doc: "postgres:\n  url: postgres://a@db/app\n  url: postgres://b@db/app\n" + tbl,
			path: "postgres.url", hint: "given twice (first on line 2)"},
		{name: "top level not a mapping", doc: "- postgres\n",
			path: "(top level)", hint: "expected a mapping"},
		{name: "tables not a list", doc: pg + "tables: public.outbox\n",
			path: "tables", hint: "expected a list"},
		{name: "stream_subjects not a list", doc: pg + tbl + "nats: {stream_subjects: {a: b}}\n",
			path: "nats.stream_subjects", hint: "expected a list"},
		{name: "duration without unit", doc: pg + tbl + "nats: {ack_timeout: 5}\n",
			path: "nats.ack_timeout", hint: "write e.g. 5s"},
		{name: "duration not parsable", doc: pg + tbl + "shutdown_timeout: soon\n",
			path: "shutdown_timeout", hint: "use e.g. 500ms, 5s or 2m"},
		{name: "duration env var", doc: pg + tbl, env: map[string]string{"OUTBOX_RELAY_POSTGRES_STATUS_INTERVAL": "often"},
			path: "postgres.status_interval", hint: "OUTBOX_RELAY_POSTGRES_STATUS_INTERVAL"},
		{name: "bool env var", doc: pg + tbl, env: map[string]string{"OUTBOX_RELAY_NATS_CREATE_STREAMS": "yes"},
			path: "nats.create_streams", hint: "use true or false"},
		{name: "bool in file as number", doc: pg + tbl + "http: {pprof: 1}\n",
			path: "http.pprof", hint: "expected true or false"},
		{name: "bool in file as word", doc: "postgres: {url: 'postgres://relay@db/app', auto_setup: maybe}\n" + tbl,
			path: "postgres.auto_setup", hint: "expected true or false"},
		{name: "int env var", doc: pg + tbl, env: map[string]string{"OUTBOX_RELAY_NATS_MAX_IN_FLIGHT": "many"},
			path: "nats.max_in_flight", hint: "not an integer"},
		{name: "int flag", doc: pg + tbl, flags: map[string]string{"nats.max_in_flight": "1k"},
			path: "nats.max_in_flight", hint: "not an integer"},
		{name: "int as quoted string", doc: pg + tbl + "nats: {max_in_flight: '100'}\n",
			path: "nats.max_in_flight", hint: "expected an integer"},
		// postgres section values.
		{name: "slot name with capitals", doc: "postgres: {url: 'postgres://relay@db/app', slot: Outbox-Relay}\n" + tbl,
			path: "postgres.slot", hint: "lower-case letters, digits and underscores"},
		{name: "publication name too long", doc: "postgres: {url: 'postgres://relay@db/app', publication: " + strings.Repeat("p", 64) + "}\n" + tbl,
			path: "postgres.publication", hint: "1-63"},
		{name: "status interval too long", doc: "postgres: {url: 'postgres://relay@db/app', status_interval: 1m}\n" + tbl,
			path: "postgres.status_interval", hint: "wal_sender_timeout"},
		// nats section values.
		{name: "stream and dead-letter stream equal", doc: pg + tbl + "nats: {stream: EVENTS, dead_letter_stream: EVENTS}\n",
			path: "nats.dead_letter_stream", hint: "must differ from nats.stream"},
		{name: "stream name with dot", doc: pg + tbl + "nats: {stream: outbox.events}\n",
			path: "nats.stream", hint: "letters, digits, _ and -"},
		{name: "replicas out of range", doc: pg + tbl + "nats: {replicas: 7}\n",
			path: "nats.replicas", hint: "1 to 5"},
		{name: "duplicate window too short", doc: pg + tbl + "nats: {duplicate_window: 500ms}\n",
			path: "nats.duplicate_window", hint: "longest relay outage"},
		{name: "max age under the duplicate window", doc: pg + tbl + "nats: {max_age: 1m}\n",
			path: "nats.max_age", hint: "shorter than nats.duplicate_window"},
		{name: "max in flight zero", doc: pg + tbl + "nats: {max_in_flight: 0}\n",
			path: "nats.max_in_flight", hint: "1 to 1048576"},
		{name: "unsettled bound below the window", doc: pg + tbl + "nats: {max_in_flight: 4096, max_unsettled_transactions: 100}\n",
			path: "nats.max_unsettled_transactions", hint: "below nats.max_in_flight"},
		{name: "unsettled WAL bound too small", doc: pg + tbl + "nats: {max_unsettled_wal_bytes: 1000}\n",
			path: "nats.max_unsettled_wal_bytes", hint: "at least 1048576"},
		{name: "stall warning too short", doc: pg + tbl + "nats: {stall_warning: 10ms}\n",
			path: "nats.stall_warning", hint: "at least 1s"},
		{name: "stream subjects do not cover the template", doc: pg + tbl + "nats: {stream_subjects: [events.>]}\n",
			path: "nats.stream_subjects", hint: "do not cover \"outbox.*.*\""},
		{name: "stream subjects overlap the dead letters", doc: pg + tbl + "nats: {stream_subjects: ['>']}\n",
			path: "nats.stream_subjects", hint: "overlaps the dead-letter subjects \"outbox_dlq.>\""},
		{name: "credentials file and user", doc: pg + tbl + "nats: {credentials_file: /etc/nats/relay.creds, user: relay}\n",
			path: "nats.credentials_file", hint: "set only one of"},
		{name: "user and nkey", doc: pg + tbl + "nats: {nkey_seed_file: /etc/nats/seed, user: relay}\n",
			path: "nats.nkey_seed_file", hint: "set only one of"},
		{name: "password without user", doc: pg + tbl, env: map[string]string{"OUTBOX_RELAY_NATS_PASSWORD": "pw"},
			path: "nats.password", hint: "set the user too"},
		{name: "cert without key", doc: pg + tbl + "nats: {cert_file: /etc/nats/relay.crt}\n",
			path: "nats.key_file", hint: "required with nats.cert_file"},
		{name: "key without cert", doc: pg + tbl + "nats: {key_file: /etc/nats/relay.key}\n",
			path: "nats.cert_file", hint: "required with nats.key_file"},
		// http, log, shutdown.
		{name: "http listen without port", doc: pg + tbl + "http: {listen: '9187'}\n",
			path: "http.listen", hint: "host:port"},
		{name: "log level", doc: pg + tbl + "log: {level: verbose}\n",
			path: "log.level", hint: "debug, info, warn or error"},
		{name: "log format flag", doc: pg + tbl, flags: map[string]string{"log.format": "text"},
			path: "log.format", hint: "use json or console"},
		{name: "shutdown timeout too long", doc: pg + tbl + "shutdown_timeout: 1h\n",
			path: "shutdown_timeout", hint: "0 to 5m"},
		// Router keys: paths come from the router.
		{name: "no tables", doc: pg,
			path: "tables", hint: "tables: [{table: public.outbox}]"},
		{name: "empty table name", doc: pg + "tables: [{table: ''}]\n",
			path: "tables[0].table", hint: "e.g. public.outbox"},
		{name: "wildcard in subject template", doc: pg + "tables: [{table: public.outbox, subject: 'outbox.*.{aggregate_id}'}]\n",
			path: "tables[0].subject", hint: "subjects published to must be literal"},
		{name: "unknown placeholder", doc: pg + "tables: [{table: public.outbox}, {table: billing.events, subject: 'billing.{aggregate}.{aggregate_id}'}]\n",
			path: "tables[1].subject", hint: "unknown placeholder {aggregate}"},
		{name: "unbalanced braces", doc: pg + "tables: [{table: public.outbox, subject: 'outbox.{aggregate_id'}]\n",
			path: "tables[0].subject", hint: "unbalanced braces"},
		{name: "subject overlaps dead letters", doc: pg + "tables: [{table: public.outbox, subject: 'outbox_dlq.{aggregate_id}'}]\n",
			path: "tables[0].subject", hint: "change the subject or dead_letter_subject"},
		{name: "duplicate table mapping", doc: pg + "tables: [{table: public.outbox}, {table: outbox}]\n",
			path: "tables[1].table", hint: "already mapped by tables[0] (merge the two entries)"},
		{name: "constant and column aggregate type", doc: pg + "tables: [{table: public.outbox, aggregate_type: order, columns: {aggregate_type: kind}}]\n",
			path: "tables[0].aggregate_type", hint: "choose one"},
		{name: "header collides with the contract", doc: pg + "tables: [{table: public.outbox, headers: {trace: Nats-Msg-Id}}]\n",
			path: "tables[0].headers.trace", hint: "choose another name"},
		{name: "headers not a mapping", doc: pg + "tables: [{table: public.outbox, headers: [trace_id]}]\n",
			path: "tables[0].headers", hint: "expected a mapping"},
		{name: "column name too long", doc: pg + "tables: [{table: public.outbox, columns: {payload: " + strings.Repeat("c", 64) + "}}]\n",
			path: "tables[0].columns.payload", hint: "longer than 63 bytes"},
		// Table-less events: paths under messages[], also for the router's
		// checks of their synthetic tables.
		{name: "message prefix with a dot", doc: pg + tbl + "messages: [{prefix: a.b}]\n",
			path: "messages[0].prefix", hint: "letters, digits, _ or -"},
		{name: "message prefix twice", doc: pg + tbl + "messages: [{prefix: ev}, {prefix: ev}]\n",
			path: "messages[1].prefix", hint: "mapped twice"},
		{name: "message subject template", doc: pg + "tables: [{table: public.outbox}, {table: public.other}]\nmessages: [{prefix: ev}, {prefix: ev2, subject: 'ev.{nope}'}]\n",
			path: "messages[1].subject", hint: "unknown placeholder {nope}"},
		{name: "unknown message key", doc: pg + tbl + "messages: [{prefix: ev, subjet: x}]\n",
			path: "messages[0].subjet", hint: "did you mean subject? (known keys here: aggregate_type, cloudevents, prefix, subject"},
		{name: "cloudevents source without enabled", doc: pg + "tables: [{table: public.outbox, cloudevents: {source: /shop}}]\n",
			path: "tables[0].cloudevents.source", hint: "enable it or remove source"},
		{name: "message cloudevents source not a URI", doc: pg + tbl + "messages: [{prefix: ev, cloudevents: {enabled: true, source: '%zz'}}]\n",
			path: "messages[0].cloudevents.source", hint: "is not a URI reference"},
		{name: "unknown cloudevents key", doc: pg + "tables: [{table: public.outbox, cloudevents: {enable: true}}]\n",
			path: "tables[0].cloudevents.enable", hint: "did you mean enabled?"},
		{name: "dead-letter subject with wildcard", doc: pg + tbl + "dead_letter_subject: 'dlq.>'\n",
			path: "dead_letter_subject", hint: "give a literal subject"},
		{name: "max subject bytes too large", doc: pg + tbl + "max_subject_bytes: 5000\n",
			path: "max_subject_bytes", hint: "1 to 4000"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			src := config.Sources{Env: envOf(tc.env), Flags: tc.flags}
			if tc.doc != "" {
				src.File = writeConfig(t, tc.doc)
			}
			_, err := config.Load(src)
			if err == nil {
				t.Fatalf("Load succeeded, want an error naming %s", tc.path)
			}
			if !errors.Is(err, config.ErrInvalid) {
				t.Errorf("error does not wrap config.ErrInvalid: %v", err)
			}
			var first *config.Error
			if !errors.As(err, &first) {
				t.Fatalf("no *config.Error in %v", err)
			}
			t.Log(err)
			var paths []string
			for _, ce := range configErrors(err) {
				paths = append(paths, ce.Path)
				if ce.Path == tc.path {
					if !strings.Contains(ce.Msg, tc.hint) {
						t.Errorf("error for %s = %q, want it to contain %q", ce.Path, ce.Msg, tc.hint)
					}
					if !strings.Contains(err.Error(), tc.path+": ") {
						t.Errorf("error text %q does not start a line with the path %s", err, tc.path)
					}
					return
				}
			}
			t.Fatalf("no error names %s; got paths %v: %v", tc.path, paths, err)
		})
	}
	if len(tests) < 20 {
		t.Fatalf("only %d invalid cases", len(tests))
	}
}

// Every problem is reported at once, not only the first.
func TestValidateReportsEveryProblem(t *testing.T) {
	t.Parallel()
	doc := "postgres: {url: 'postgres://relay@db/app', slot: BAD}\n" +
		"nats: {replicas: 9}\n" +
		"tables: [{table: public.outbox, subject: 'a.{nope}'}, {table: public.outbox}]\n" +
		"log: {format: xml}\n"
	_, err := config.Load(config.Sources{File: writeConfig(t, doc)})
	got := map[string]bool{}
	for _, ce := range configErrors(err) {
		got[ce.Path] = true
	}
	for _, p := range []string{"postgres.slot", "nats.replicas", "tables[0].subject", "tables[1].table", "log.format"} {
		if !got[p] {
			t.Errorf("no error for %s in %v", p, err)
		}
	}
}

// A password never reaches an error message, wherever the URL came from.
func TestErrorsNeverShowPasswords(t *testing.T) {
	t.Parallel()
	const secret = "s3cr3tPW"
	tests := []struct {
		name string
		doc  string
		env  map[string]string
	}{
		{name: "postgres url in file without host", doc: "postgres: {url: 'postgres://relay:" + secret + "@/app'}\n" + tbl},
		{name: "postgres url in file unparsable", doc: "postgres: {url: 'postgres://relay:" + secret + "@db:port/app'}\n" + tbl},
		{name: "postgres url in env without database",
			doc: tbl, env: map[string]string{"OUTBOX_RELAY_POSTGRES_URL": "postgres://relay:" + secret + "@db:5432"}},
		{name: "postgres url in env as a non-url",
			doc: tbl, env: map[string]string{"OUTBOX_RELAY_POSTGRES_URL": "relay:" + secret + "@db/app"}},
		{name: "nats url in file without host", doc: pg + tbl + "nats: {url: 'nats://relay:" + secret + "@'}\n"},
		{name: "nats url in env unparsable",
			doc: pg + tbl, env: map[string]string{"OUTBOX_RELAY_NATS_URL": "nats://relay:" + secret + "@nats:4222/%zz"}},
		{name: "nats url in env without scheme",
			doc: pg + tbl, env: map[string]string{"OUTBOX_RELAY_NATS_URL": "relay:" + secret + "@nats:4222"}},
		{name: "nats url in env with bad scheme",
			doc: pg + tbl, env: map[string]string{"OUTBOX_RELAY_NATS_URL": "http://relay:" + secret + "@nats:4222"}},
		{name: "nats password without user",
			doc: pg + tbl, env: map[string]string{"OUTBOX_RELAY_NATS_PASSWORD": secret}},
		{name: "nats password with user and credentials",
			doc: pg + tbl + "nats: {user: relay, password: " + secret + ", credentials_file: /x.creds}\n"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := config.Load(config.Sources{File: writeConfig(t, tc.doc), Env: envOf(tc.env)})
			if err == nil {
				t.Fatal("Load succeeded, want an error")
			}
			if strings.Contains(err.Error(), secret) {
				t.Fatalf("error shows the password: %v", err)
			}
		})
	}
}

func TestRedactURL(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"nats://relay:pw@nats:4222":      "nats://relay:xxxxx@nats:4222",
		"nats://nats:4222":               "nats://nats:4222",
		"postgres://relay@db/app":        "postgres://relay@db/app",
		"postgres://relay:pw@db:x/app":   "postgres://xxxxx@db:x/app",
		"relay:pw@db/app":                "xxxxx@db/app",
		"postgres://relay:p@ss@db:1/app": "postgres://relay:xxxxx@db:1/app",
	} {
		if got := config.RedactURL(in); got != want {
			t.Errorf("RedactURL(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestEnvKeys(t *testing.T) {
	t.Parallel()
	keys := config.EnvKeys()
	for env, path := range map[string]string{
		"OUTBOX_RELAY_POSTGRES_URL":          "postgres.url",
		"OUTBOX_RELAY_NATS_URL":              "nats.url",
		"OUTBOX_RELAY_NATS_MAX_IN_FLIGHT":    "nats.max_in_flight",
		"OUTBOX_RELAY_NATS_STREAM_SUBJECTS":  "nats.stream_subjects",
		"OUTBOX_RELAY_DEAD_LETTER_SUBJECT":   "dead_letter_subject",
		"OUTBOX_RELAY_SHUTDOWN_TIMEOUT":      "shutdown_timeout",
		"OUTBOX_RELAY_HTTP_LISTEN":           "http.listen",
		"OUTBOX_RELAY_NATS_DUPLICATE_WINDOW": "nats.duplicate_window",
	} {
		if keys[env] != path {
			t.Errorf("EnvKeys()[%s] = %q, want %q", env, keys[env], path)
		}
	}
	for env := range keys {
		if strings.Contains(env, "TABLES") {
			t.Errorf("EnvKeys lists %s: tables come from the file only", env)
		}
	}
}

// Environment values for lists are comma-separated.
func TestEnvList(t *testing.T) {
	t.Parallel()
	cfg, err := config.Load(config.Sources{File: writeConfig(t, pg+tbl), Env: envOf(map[string]string{
		"OUTBOX_RELAY_NATS_STREAM_SUBJECTS": "outbox.>, ,extra.*",
	})})
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"outbox.>", "extra.*"}; !reflect.DeepEqual(cfg.NATS.StreamSubjects, want) {
		t.Fatalf("stream_subjects = %q, want %q", cfg.NATS.StreamSubjects, want)
	}
}
