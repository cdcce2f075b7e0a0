package helmtest

import (
	"fmt"
	"os"
	"sort"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// The relay's configuration keys come from testdata/full.yaml, which lists
// every key with its default: this module cannot import the relay's
// internal/config without pulling the relay's dependencies in, and the
// relay itself refuses unknown keys at start, so a key here that is not in
// full.yaml is a pod that never becomes Ready.

// envPrefix is the relay's environment prefix (internal/config.EnvPrefix).
const envPrefix = "OUTBOX_RELAY_"

// fullConfig reads testdata/full.yaml as YAML.
func fullConfig(t *testing.T) map[string]any {
	t.Helper()
	data, err := os.ReadFile(fullConfigPath)
	if err != nil {
		t.Fatal(err)
	}
	var full map[string]any
	if err := yaml.Unmarshal(data, &full); err != nil {
		t.Fatalf("%s: %v", fullConfigPath, err)
	}
	return full
}

// keyProblems lists where got, a parsed configuration, strays from the
// shape of schema (full.yaml): keys it does not have, a map or a list
// where it has a scalar, and the reverse. A list is checked element by
// element against the schema's first element; an empty map in the schema
// (tables[].headers) holds user-chosen keys with scalar values.
func keyProblems(path string, got, schema any) []string {
	switch g := got.(type) {
	case map[string]any:
		s, ok := schema.(map[string]any)
		if !ok {
			return []string{fmt.Sprintf("%s: a map, where testdata/full.yaml has %s", orRoot(path), shape(schema))}
		}
		var problems []string
		for _, k := range sortedKeys(g) {
			p := join(path, k)
			if len(s) == 0 {
				if shape(g[k]) != "a scalar" {
					problems = append(problems, fmt.Sprintf("%s: %s, want a scalar", p, shape(g[k])))
				}
				continue
			}
			sub, known := s[k]
			if !known {
				problems = append(problems, fmt.Sprintf("%s: not a configuration key (known here: %s)", p, strings.Join(sortedKeys(s), ", ")))
				continue
			}
			problems = append(problems, keyProblems(p, g[k], sub)...)
		}
		return problems
	case []any:
		s, ok := schema.([]any)
		if !ok {
			return []string{fmt.Sprintf("%s: a list, where testdata/full.yaml has %s", path, shape(schema))}
		}
		var problems []string
		for i, e := range g {
			p := fmt.Sprintf("%s[%d]", path, i)
			if len(s) == 0 {
				if shape(e) != "a scalar" {
					problems = append(problems, fmt.Sprintf("%s: %s, want a scalar", p, shape(e)))
				}
				continue
			}
			problems = append(problems, keyProblems(p, e, s[0])...)
		}
		return problems
	default:
		if shape(schema) != "a scalar" {
			return []string{fmt.Sprintf("%s: a scalar, where testdata/full.yaml has %s", path, shape(schema))}
		}
		return nil
	}
}

// envNames returns the environment variable of every key that has one:
// each scalar, and each list of scalars (comma-separated), outside the
// lists of maps (tables, messages), which come from the file only.
func envNames(path string, schema any, out map[string]bool) {
	switch s := schema.(type) {
	case map[string]any:
		for k, v := range s {
			envNames(join(path, k), v, out)
		}
	case []any:
		if len(s) == 0 || shape(s[0]) == "a scalar" {
			out[envName(path)] = true
		}
	default:
		out[envName(path)] = true
	}
}

func envName(path string) string {
	return envPrefix + strings.ToUpper(strings.ReplaceAll(path, ".", "_"))
}

func shape(v any) string {
	switch v.(type) {
	case map[string]any:
		return "a map"
	case []any:
		return "a list"
	}
	return "a scalar"
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

func orRoot(path string) string {
	if path == "" {
		return "the configuration"
	}
	return path
}

func sortedKeys(m map[string]any) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// TestKeyCheckerCatches shows the checker refuses what the relay would:
// without it, the chart tests could pass on a configuration the relay
// rejects at start.
func TestKeyCheckerCatches(t *testing.T) {
	full := fullConfig(t)
	for _, tc := range []struct {
		name, config, want string
	}{
		{"misspelt key", "nats:\n  max_inflight: 10\n", "nats.max_inflight: not a configuration key"},
		{"unknown section", "telemetry:\n  enabled: true\n", "telemetry: not a configuration key"},
		{"key in a table", "tables:\n  - table: public.outbox\n    colums: {}\n", "tables[0].colums: not a configuration key"},
		{"map for a scalar", "postgres:\n  slot:\n    name: x\n", "postgres.slot: a map"},
		{"scalar for a map", "nats: nats://x\n", "nats: a scalar"},
		{"list in a header", "tables:\n  - table: t\n    headers:\n      c: [a]\n", "tables[0].headers.c: a list"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var cfg map[string]any
			if err := yaml.Unmarshal([]byte(tc.config), &cfg); err != nil {
				t.Fatal(err)
			}
			problems := keyProblems("", cfg, full)
			if len(problems) != 1 || !strings.Contains(problems[0], tc.want) {
				t.Fatalf("problems %q, want one containing %q", problems, tc.want)
			}
		})
	}
	var cfg map[string]any
	if err := yaml.Unmarshal([]byte("nats:\n  stream_subjects: [a.>]\ntables:\n  - table: t\n    headers: {tenant: Tenant}\n"), &cfg); err != nil {
		t.Fatal(err)
	}
	if problems := keyProblems("", cfg, full); len(problems) != 0 {
		t.Fatalf("a valid configuration: %q", problems)
	}
	if problems := keyProblems("", full, full); len(problems) != 0 {
		t.Fatalf("full.yaml against itself: %q", problems)
	}
	env := map[string]bool{}
	envNames("", full, env)
	for _, name := range []string{"OUTBOX_RELAY_POSTGRES_URL", "OUTBOX_RELAY_NATS_PASSWORD", "OUTBOX_RELAY_NATS_CREDENTIALS_FILE", "OUTBOX_RELAY_NATS_STREAM_SUBJECTS", "OUTBOX_RELAY_HTTP_LISTEN"} {
		if !env[name] {
			t.Errorf("%s: not derived from full.yaml", name)
		}
	}
	for _, name := range []string{"OUTBOX_RELAY_TABLES", "OUTBOX_RELAY_TABLES_TABLE", "OUTBOX_RELAY_NATS"} {
		if env[name] {
			t.Errorf("%s: derived from full.yaml, but it is no scalar key", name)
		}
	}
}
