package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// The alert rules pass promtool's check and their unit tests
// (deploy/prometheus/alerts_test.yml), among them an HA pair whose standby
// retries all day and must not page anyone. .ci/run installs promtool
// (Debian's prometheus package); elsewhere the test is skipped without it.
func TestAlertRules(t *testing.T) {
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("promtool not found: .ci/run installs it with `apt-get install prometheus`")
		}
		t.Skip("promtool not installed (apt-get install prometheus)")
	}
	dir := filepath.Join(testenv.RepoRoot(t), "deploy", "prometheus")
	tests, err := filepath.Glob(filepath.Join(dir, "alerts*_test.yml"))
	if err != nil || len(tests) == 0 {
		t.Fatalf("no promtool test files in %s (%v)", dir, err)
	}
	for i := range tests {
		tests[i] = filepath.Base(tests[i])
	}
	for _, args := range [][]string{
		{"check", "rules", "alerts.yml"},
		append([]string{"test", "rules"}, tests...),
	} {
		cmd := exec.Command(promtool, args...)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Errorf("promtool %v: %v\n%s", args, err, out)
		}
	}
}
