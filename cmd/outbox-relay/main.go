// Command outbox-relay relays a PostgreSQL transactional outbox to NATS
// JetStream through logical replication. See the README for the
// configuration reference and the subcommands.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/outbox-relay/outbox-relay/internal/config"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

// exitCode carries a specific process exit status out of a command.
type exitCode int

func (e exitCode) Error() string { return fmt.Sprintf("exit status %d", int(e)) }

// usageError is a command used wrongly: exit status 2, as for a
// configuration error, without that label.
type usageError string

func (e usageError) Error() string { return string(e) }

func main() {
	root := newRootCmd()
	err := root.Execute()
	var code exitCode
	switch {
	case err == nil:
	case errors.As(err, &code):
		os.Exit(int(code))
	default:
		fmt.Fprintln(os.Stderr, "outbox-relay:", err)
		var usage usageError
		if errors.Is(err, config.ErrInvalid) || errors.As(err, &usage) {
			os.Exit(2)
		}
		os.Exit(1)
	}
}

// globals are the flags every subcommand shares.
type globals struct {
	configFile string
	flags      map[string]*string // key path -> flag value
	cmd        *cobra.Command
	// logWarnings: the command logs the configuration's warnings itself
	// (run, through its logger) instead of load printing them.
	logWarnings bool
}

// flagKeys are the configuration keys that have a command-line flag.
var flagKeys = []struct{ name, path, usage string }{
	{"postgres-url", "postgres.url", "PostgreSQL connection URL (env OUTBOX_RELAY_POSTGRES_URL)"},
	{"slot", "postgres.slot", "replication slot name"},
	{"publication", "postgres.publication", "publication name"},
	{"nats-url", "nats.url", "NATS server URL(s), comma-separated (env OUTBOX_RELAY_NATS_URL)"},
	{"stream", "nats.stream", "JetStream stream for events"},
	{"http-listen", "http.listen", "address for /metrics, /healthz and /readyz; empty disables"},
	{"log-level", "log.level", "debug, info, warn or error"},
	{"log-format", "log.format", "json (default) or console"},
}

func newRootCmd() *cobra.Command {
	g := &globals{flags: map[string]*string{}}
	root := &cobra.Command{
		Use:           "outbox-relay",
		Short:         "Relay a PostgreSQL transactional outbox to NATS JetStream",
		Long:          "outbox-relay streams outbox INSERTs from a logical replication slot (pgoutput),\nroutes each row to a JetStream subject per aggregate and confirms the slot's\nposition only after JetStream acknowledged the events.",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.PersistentFlags().StringVarP(&g.configFile, "config", "c", os.Getenv(config.ConfigFileEnv), "YAML configuration file (env OUTBOX_RELAY_CONFIG)")
	for _, f := range flagKeys {
		g.flags[f.path] = root.PersistentFlags().String(f.name, "", f.usage)
	}
	g.cmd = root
	root.AddCommand(newRunCmd(g), newSetupCmd(g), newStatusCmd(g), newTeardownCmd(g), newReconcileCmd(g), newCleanupCmd(g), newDLQCmd(g), newVersionCmd())
	return root
}

// load reads the configuration with precedence flag > env > file > default.
func (g *globals) load() (config.Config, error) {
	set := map[string]string{}
	for _, f := range flagKeys {
		if g.cmd.PersistentFlags().Changed(f.name) {
			set[f.path] = *g.flags[f.path]
		}
	}
	cfg, err := config.Load(config.Sources{File: g.configFile, Env: os.LookupEnv, Environ: os.Environ(), Flags: set})
	if err == nil && !g.logWarnings {
		for _, w := range cfg.Warnings {
			fmt.Fprintln(g.cmd.ErrOrStderr(), "outbox-relay: warning:", w)
		}
	}
	return cfg, err
}

// loadOnly loads the configuration for a command that uses only the keys
// under the given prefixes (e.g. "nats."): invalid or missing keys
// elsewhere, such as postgres.url or tables, are no reason to refuse it.
func (g *globals) loadOnly(prefixes ...string) (config.Config, error) {
	cfg, err := g.load()
	if err == nil {
		return cfg, nil
	}
	var joined interface{ Unwrap() []error }
	if !errors.As(err, &joined) {
		return cfg, onlyConcerning(err, prefixes)
	}
	var keep []error
	for _, e := range joined.Unwrap() {
		if e = onlyConcerning(e, prefixes); e != nil {
			keep = append(keep, e)
		}
	}
	return cfg, errors.Join(keep...)
}

// onlyConcerning returns err unless it is a configuration error of a key
// outside prefixes.
func onlyConcerning(err error, prefixes []string) error {
	var ce *config.Error
	if !errors.As(err, &ce) {
		return err
	}
	for _, p := range prefixes {
		if strings.HasPrefix(ce.Path, p) {
			return err
		}
	}
	return nil
}

func newVersionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the version",
		Args:  cobra.NoArgs,
		Run: func(cmd *cobra.Command, _ []string) {
			fmt.Fprintln(cmd.OutOrStdout(), "outbox-relay", version)
		},
	}
}

func signalContext() (context.Context, context.CancelFunc) {
	return notifyContext(context.Background())
}
