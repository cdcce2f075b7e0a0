package faults

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// The outbox table is dropped from the publication under load and added
// back, twice: once for longer than a check (the relay stops streaming and
// confirming, goes not ready, and on the fix publishes the withheld rows
// before streaming on), once for a few milliseconds (the Relation message
// before the first row after ADD TABLE makes the relay check, find the
// publication redefined and do the same). Regression (issue 25): the slot
// confirmed past the withheld rows and they were never relayed. In both
// publishing modes; 0 missing, 0 out of order, no confirmed LSN ahead of
// an unpublished event.
func TestPublicationDroppedWhileStreaming(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"auto", "off"} {
		t.Run("batch_publish="+mode, func(t *testing.T) {
			t.Parallel()
			publicationDropped(t, mode)
		})
	}
}

func publicationDropped(t *testing.T, batchPublish string) {
	env := testenv.Get(t)
	s := newScenario(t, env.PG, env.NATS.URL)
	s.set("nats.batch_publish", batchPublish)
	s.set("postgres.publication_check_interval", "1s")
	s.sample()
	ctx := context.Background()
	r := s.startRelay()
	s.waitSlotActive(30 * time.Second)
	ld := startLoad(t, s.db.Pool, loadSpec{Writers: 2, Aggregates: 50, TxRows: []int{1, 1, 5}, Pause: 2 * time.Millisecond})
	pub := `"` + s.name + `"`
	var worst time.Duration
	for _, hold := range []time.Duration{3 * time.Second, 0} {
		n, _ := s.streamState(ctx, s.stream)
		s.waitCount(s.stream, n+200, 60*time.Second)
		since := time.Now()
		s.exec(ctx, `ALTER PUBLICATION `+pub+` DROP TABLE outbox`)
		if hold > 0 {
			if _, ok := r.waitLog(since, 10*time.Second, func(e logEntry) bool {
				return strings.HasPrefix(e.Msg, "publication wrong") && strings.Contains(e.Error, "not in the publication")
			}); !ok {
				t.Fatal("no error logged with the outbox missing from the publication")
			}
			time.Sleep(hold) // rows the publication withholds, under load
		}
		s.exec(ctx, `ALTER PUBLICATION `+pub+` ADD TABLE outbox`)
		s.logf("outbox dropped from the publication for %s and added back", time.Since(since).Round(time.Millisecond))
		// verify says whether the gap's rows came; the log says when.
		filled, ok := r.waitLog(since, 30*time.Second, func(e logEntry) bool { return strings.HasPrefix(e.Msg, "publication gap filled") })
		if !ok {
			s.logf("no publication gap filled within 30s")
			filled = time.Now()
		}
		_, last := s.streamState(ctx, s.stream)
		rec := s.waitProgress(last, 60*time.Second)
		worst = max(worst, filled.Sub(since)+rec)
	}
	ld.stop()
	o := s.verify(2 * time.Minute)
	s.mustHold("outbox dropped from the publication and added back, batch_publish "+batchPublish, o, worst,
		fmt.Sprintf("%s and a quick drop/add", 3*time.Second))
}
