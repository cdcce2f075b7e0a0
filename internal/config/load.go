package config

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"reflect"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

// EnvPrefix starts every environment variable the relay reads.
const EnvPrefix = "OUTBOX_RELAY_"

// Sources are the inputs of Load besides defaults.
type Sources struct {
	// File is the YAML file's path; empty for none.
	File string
	// Env looks up an environment variable (os.LookupEnv in main).
	Env func(string) (string, bool)
	// Environ is the whole environment (os.Environ in main), to tell about
	// OUTBOX_RELAY_* variables that are no configuration key: one a letter
	// or two away from a key is an error, any other a warning.
	Environ []string
	// Flags maps key paths (e.g. "postgres.url") to values given on the
	// command line; only flags the user set belong here.
	Flags map[string]string
}

// Load builds the configuration: defaults, then the file, then environment
// variables, then flags; then Validate.
func Load(src Sources) (Config, error) {
	cfg := Default()
	if src.File != "" {
		b, err := os.ReadFile(src.File)
		if err != nil {
			return cfg, fmt.Errorf("%w: read config file: %w", ErrInvalid, err)
		}
		if err := decodeYAML(b, &cfg); err != nil {
			return cfg, fmt.Errorf("%s: %w", src.File, err)
		}
	}
	if src.Env != nil {
		if err := applyEnv(&cfg, src.Env); err != nil {
			return cfg, err
		}
	}
	if err := checkEnviron(&cfg, src.Environ); err != nil {
		return cfg, err
	}
	for path, v := range src.Flags {
		f, ok := fieldByPath(reflect.ValueOf(&cfg).Elem(), path)
		if !ok {
			return cfg, &Error{Path: path, Msg: "is not a configuration key"}
		}
		if err := setScalar(f, v); err != nil {
			return cfg, &Error{Path: path, Msg: fmt.Sprintf("flag value %q: %v", v, err)}
		}
	}
	return cfg, cfg.Validate()
}

func decodeYAML(b []byte, cfg *Config) error {
	var root yaml.Node
	if err := yaml.Unmarshal(b, &root); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	if len(root.Content) == 0 {
		return nil // empty file
	}
	if err := checkKeys(root.Content[0], reflect.TypeOf(*cfg), ""); err != nil {
		return err
	}
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(cfg); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	return nil
}

// checkKeys walks the YAML tree against the struct type so that an unknown
// or misspelt key (e.g. tables[0].colums), a key given twice, or a value of
// the wrong shape or type (a list where a mapping belongs, "5" where a
// duration needs a unit, "yes" for a boolean) is reported with its full path
// and line. The YAML decoder's own errors name only a line.
func checkKeys(n *yaml.Node, t reflect.Type, path string) error {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if n.Kind == yaml.AliasNode && n.Alias != nil {
		n = n.Alias
	}
	if n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null" {
		return nil // an empty value leaves the field at its zero value
	}
	bad := func(format string, args ...any) error {
		return &Error{Path: orRoot(path), Msg: fmt.Sprintf("line %d: ", n.Line) + fmt.Sprintf(format, args...)}
	}
	switch {
	case t == durationType:
		if n.Kind != yaml.ScalarNode {
			return bad("expected a duration such as 500ms, 5s or 2m")
		}
		if n.ShortTag() == "!!int" || n.ShortTag() == "!!float" {
			return bad("%s has no unit: write e.g. %ss (units: ms, s, m, h)", n.Value, n.Value)
		}
		if _, err := time.ParseDuration(n.Value); err != nil {
			return bad("%q is not a duration: use e.g. 500ms, 5s or 2m", n.Value)
		}
	case t.Kind() == reflect.Struct:
		if n.Kind != yaml.MappingNode {
			return bad("expected a mapping of keys")
		}
		return checkStruct(n, t, path)
	case t.Kind() == reflect.Slice:
		if n.Kind != yaml.SequenceNode {
			return bad("expected a list (e.g. [a, b] or one \"- item\" per line)")
		}
		var errs []error
		for i, c := range n.Content {
			errs = append(errs, checkKeys(c, t.Elem(), fmt.Sprintf("%s[%d]", path, i)))
		}
		return errors.Join(errs...)
	case t.Kind() == reflect.Map:
		if n.Kind != yaml.MappingNode {
			return bad("expected a mapping (key: value per line)")
		}
		var errs []error
		for i := 0; i+1 < len(n.Content); i += 2 {
			errs = append(errs, checkKeys(n.Content[i+1], t.Elem(), join(path, n.Content[i].Value)))
		}
		return errors.Join(errs...)
	case t.Kind() == reflect.Bool:
		if n.Kind != yaml.ScalarNode || n.ShortTag() != "!!bool" {
			return bad("expected true or false")
		}
	case t.Kind() == reflect.Int:
		if n.Kind != yaml.ScalarNode || n.ShortTag() != "!!int" {
			return bad("expected an integer")
		}
		if _, err := strconv.ParseInt(strings.ReplaceAll(n.Value, "_", ""), 0, strconv.IntSize); err != nil {
			return bad("%s is not an integer in range", n.Value)
		}
	case t.Kind() == reflect.String:
		if n.Kind != yaml.ScalarNode {
			return bad("expected a single value, not a list or mapping (quote it if it contains ': ' or starts with '[' or '{')")
		}
	}
	return nil
}

// checkStruct checks a mapping's keys against the struct type t and
// reports every unknown key, each with its did-you-mean, and every error
// below them at once: two typos no longer take two runs.
func checkStruct(n *yaml.Node, t reflect.Type, path string) error {
	fields := yamlFields(t)
	seen := make(map[string]int, len(n.Content)/2)
	var errs []error
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		sub := join(path, k.Value)
		ft, ok := fields[k.Value]
		if !ok {
			keys := sortedKeys(fields)
			hint := ""
			if best, ok := closest(k.Value, keys); ok {
				hint = fmt.Sprintf(": did you mean %s?", best)
			}
			errs = append(errs, &Error{Path: sub, Msg: fmt.Sprintf("line %d: unknown key%s (known keys here: %s)", k.Line, hint, strings.Join(keys, ", "))})
			continue
		}
		if first, dup := seen[k.Value]; dup {
			errs = append(errs, &Error{Path: sub, Msg: fmt.Sprintf("line %d: given twice (first on line %d): keep one", k.Line, first)})
			continue
		}
		seen[k.Value] = k.Line
		errs = append(errs, checkKeys(v, ft, sub))
	}
	return errors.Join(errs...)
}

var durationType = reflect.TypeOf(time.Duration(0))

func orRoot(p string) string {
	if p == "" {
		return "(top level)"
	}
	return p
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

// yamlFields maps the YAML keys of struct type t to their types, expanding
// inline structs.
func yamlFields(t reflect.Type) map[string]reflect.Type {
	out := map[string]reflect.Type{}
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		name, opts, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if name == "-" || !f.IsExported() {
			continue
		}
		if strings.Contains(opts, "inline") {
			for k, v := range yamlFields(f.Type) {
				out[k] = v
			}
			continue
		}
		if name == "" {
			name = strings.ToLower(f.Name)
		}
		out[name] = f.Type
	}
	return out
}

func sortedKeys(m map[string]reflect.Type) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	for i := 1; i < len(keys); i++ {
		for j := i; j > 0 && keys[j] < keys[j-1]; j-- {
			keys[j], keys[j-1] = keys[j-1], keys[j]
		}
	}
	return keys
}

// EnvKeys lists every environment variable Load reads, with its key path.
func EnvKeys() map[string]string {
	out := map[string]string{}
	walkScalars(reflect.ValueOf(&Config{}).Elem(), "", func(path string, _ reflect.Value) {
		out[envName(path)] = path
	})
	return out
}

func envName(path string) string {
	return EnvPrefix + strings.ToUpper(strings.ReplaceAll(path, ".", "_"))
}

// ConfigFileEnv names the configuration file; the only OUTBOX_RELAY_*
// variable that is not a key.
const ConfigFileEnv = EnvPrefix + "CONFIG"

// checkEnviron rejects a misspelt OUTBOX_RELAY_* variable, which would
// otherwise be ignored without a word, and records a warning for any other
// unknown one (another program's, perhaps: the NATS server configuration
// in docs/faults.md reads OUTBOX_RELAY_PASSWORD).
func checkEnviron(cfg *Config, environ []string) error {
	known := EnvKeys()
	known[ConfigFileEnv] = ""
	var errs []error
	for _, kv := range environ {
		name, _, _ := strings.Cut(kv, "=")
		if _, ok := known[name]; ok || !strings.HasPrefix(name, EnvPrefix) {
			continue
		}
		names := make([]string, 0, len(known))
		for k := range known {
			names = append(names, k)
		}
		if best, ok := closest(name, names); ok {
			errs = append(errs, fmt.Errorf("%w: environment variable %s is not a configuration key: did you mean %s?", ErrInvalid, name, best))
			continue
		}
		cfg.Warnings = append(cfg.Warnings, fmt.Sprintf("environment variable %s is not a configuration key of the relay and is ignored (the keys' variables are listed in the README)", name))
	}
	return errors.Join(errs...)
}

// closest returns the candidate nearest to name, when it is at most two
// edits away: a typo, not another key. Ties go to the first in sort order.
func closest(name string, candidates []string) (string, bool) {
	best, dist := "", 3
	for _, c := range candidates {
		if d := editDistance(name, c); d < dist || d == dist && c < best {
			best, dist = c, d
		}
	}
	return best, dist <= 2
}

// editDistance is the Levenshtein distance of two ASCII names.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

func applyEnv(cfg *Config, env func(string) (string, bool)) error {
	var errs []error
	walkScalars(reflect.ValueOf(cfg).Elem(), "", func(path string, f reflect.Value) {
		name := envName(path)
		v, ok := env(name)
		if !ok {
			return
		}
		if err := setScalar(f, v); err != nil {
			errs = append(errs, &Error{Path: path, Msg: fmt.Sprintf("environment variable %s=%q: %v", name, redactValue(path, v), err)})
		}
	})
	return errors.Join(errs...)
}

func redactValue(path, v string) string {
	if strings.Contains(path, "password") {
		return "xxxxx"
	}
	if strings.HasSuffix(path, "url") {
		return redactURL(v)
	}
	return v
}

// walkScalars calls fn for every settable scalar field (string, bool, int,
// duration, []string) with its key path.
func walkScalars(v reflect.Value, path string, fn func(string, reflect.Value)) {
	t := v.Type()
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		name, opts, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if name == "-" || !f.IsExported() {
			continue
		}
		fv := v.Field(i)
		if strings.Contains(opts, "inline") {
			walkScalars(fv, path, fn)
			continue
		}
		sub := join(path, name)
		switch {
		case f.Type == reflect.TypeOf(time.Duration(0)):
			fn(sub, fv)
		case f.Type.Kind() == reflect.Struct:
			walkScalars(fv, sub, fn)
		case f.Type.Kind() == reflect.Slice && f.Type.Elem().Kind() == reflect.String:
			fn(sub, fv)
		case f.Type.Kind() == reflect.String || f.Type.Kind() == reflect.Bool || f.Type.Kind() == reflect.Int:
			fn(sub, fv)
		}
	}
}

func fieldByPath(v reflect.Value, path string) (reflect.Value, bool) {
	var found reflect.Value
	walkScalars(v, "", func(p string, f reflect.Value) {
		if p == path {
			found = f
		}
	})
	return found, found.IsValid()
}

func setScalar(f reflect.Value, s string) error {
	switch {
	case f.Type() == reflect.TypeOf(time.Duration(0)):
		d, err := time.ParseDuration(s)
		if err != nil {
			return fmt.Errorf("not a duration (use e.g. 500ms, 5s, 2m)")
		}
		f.SetInt(int64(d))
	case f.Kind() == reflect.String:
		f.SetString(s)
	case f.Kind() == reflect.Bool:
		b, err := strconv.ParseBool(s)
		if err != nil {
			return fmt.Errorf("not a boolean (use true or false)")
		}
		f.SetBool(b)
	case f.Kind() == reflect.Int:
		n, err := strconv.Atoi(s)
		if err != nil {
			return fmt.Errorf("not an integer")
		}
		f.SetInt(int64(n))
	case f.Kind() == reflect.Slice:
		var parts []string
		for _, p := range strings.Split(s, ",") {
			if p = strings.TrimSpace(p); p != "" {
				parts = append(parts, p)
			}
		}
		f.Set(reflect.ValueOf(parts))
	default:
		return fmt.Errorf("unsupported type %s", f.Type())
	}
	return nil
}
