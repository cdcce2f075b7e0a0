package publisher

import (
	"errors"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
)

func TestClassifyAPIError(t *testing.T) {
	tests := []struct {
		code      jetstream.ErrorCode
		class     string
		permanent bool
	}{
		{jetstream.JSErrCodeStreamMessageExceedsMaximum, "too_large", true},
		// Regression (issue 16, case 2): retrying a header block over
		// 64 KiB blocked its key, or a whole batch, forever.
		{errCodeHeaderTooLarge, "header_too_large", true},
		{errCodeStreamMismatch, "stream_mismatch", true},
		{10077, "api_error", false}, // maximum messages exceeded: may clear up
	}
	for _, tt := range tests {
		e := classifyAPIError("s", &jetstream.APIError{ErrorCode: tt.code})
		if e.Class != tt.class || errors.Is(e, ErrRejected) != tt.permanent || errors.Is(e, ErrTransient) == tt.permanent {
			t.Errorf("%d: class %s, rejected %v, transient %v", tt.code, e.Class, errors.Is(e, ErrRejected), errors.Is(e, ErrTransient))
		}
	}
}
