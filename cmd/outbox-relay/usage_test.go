package main

import (
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/config"
)

// teardown without --yes is a usage error (exit 2) that says what to do,
// not an "invalid configuration".
func TestTeardownWithoutYes(t *testing.T) {
	root := newRootCmd()
	root.SetArgs([]string{"teardown"})
	root.SetOut(io.Discard)
	root.SetErr(io.Discard)
	err := root.Execute()
	var usage usageError
	if !errors.As(err, &usage) || errors.Is(err, config.ErrInvalid) || !strings.Contains(err.Error(), "re-run with --yes") {
		t.Fatalf("teardown = %v, want a usage error naming --yes", err)
	}
}
