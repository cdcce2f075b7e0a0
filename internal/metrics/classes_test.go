package metrics

import (
	"testing"

	"github.com/outbox-relay/outbox-relay/publisher"
	"github.com/outbox-relay/outbox-relay/router"
)

// TestSizeClassesAgree: a row too large is one class on the dashboards
// whether the router or the broker refused it.
func TestSizeClassesAgree(t *testing.T) {
	for _, c := range [][2]string{
		{publisher.ClassTooLarge, router.ClassTooLarge},
		{publisher.ClassHeaderTooLarge, router.ClassHeaderTooLarge},
	} {
		if c[0] != c[1] {
			t.Errorf("publisher class %q, router class %q: make them one", c[0], c[1])
		}
	}
}
