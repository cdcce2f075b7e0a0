package consumer

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"
)

// enqueue puts a retried message's redelivery ahead of the worker's queue
// (behind only its own aggregate's earlier messages). These tests drive a
// worker's queue by hand, without servers, where that meets a batch's
// fallback: messages put back unattempted, and w.solo, which counts
// messages assumed at the queue's front.

// queuedItem is a delivery of aggregate key at stream sequence seq, for a
// worker's queue.
func queuedItem(key string, seq uint64) *item {
	it := &item{msg: progressMsg{}, key: key}
	it.m.StreamSeq = seq
	it.m.ID = fmt.Sprintf("%s@%d", key, seq)
	return it
}

func itemIDs(its []*item) string {
	ids := make([]string, len(its))
	for i, it := range its {
		ids[i] = it.m.ID
	}
	return "[" + strings.Join(ids, " ") + "]"
}

// TestRedeliveryAheadOfAFallenBackBatchKeepsItOneAtATime: a batch broke for
// no single message (HandleBatch failed, or its deadline passed), so its
// three messages go back to the front of the queue to be applied one at a
// time with Handle (BatchHandler's contract; worker.solo = 3). While the
// first is processed alone, the redelivery of another aggregate's retried
// message arrives and goes ahead of the queue. It must not take one of the
// fallen-back messages' turns: the last of them would be taken in a batch
// with the messages queued after it, and a message whose HandleBatch fails
// breaks that batch too.
func TestRedeliveryAheadOfAFallenBackBatchKeepsItOneAtATime(t *testing.T) {
	c := &Consumer{cfg: Config{BatchSize: 4, HandlerTimeout: 10 * time.Second}}
	w := newWorker(c, nil, 0)
	w.blocked["h"] = &block{head: 5} // h's message at 5 was naked for a retry
	batch := []*item{queuedItem("x1", 10), queuedItem("x2", 11), queuedItem("x3", 12)}
	w.queue = []*item{queuedItem("y1", 13), queuedItem("y2", 14)}
	w.finishAll(context.Background(), batch, oneByOne(batchOutcome{res: make([]result, len(batch))}, batch, []int{0, 1, 2}))

	takes := []string{itemIDs(w.take())} // x1, alone
	w.enqueue(queuedItem("h", 5))        // h's redelivery, while x1 is processed
	for len(w.queue) > 0 {
		takes = append(takes, itemIDs(w.take()))
	}
	for _, take := range takes {
		if strings.Contains(take, "x") && strings.Contains(take, " ") {
			t.Errorf("a fallen-back message was taken in a batch %s; takes %v: want x1, x2 and x3 each alone", take, takes)
		}
	}
}

// TestRedeliveryStaysBehindItsAggregatesPutBackMessage: aggregate a's
// message at 12 failed in a batch and waits for its redelivery, while its
// message at 10 is still to be applied, in a batch in flight. The
// redelivery arrives meanwhile and goes ahead of the queue; then that
// batch breaks and its messages come back to the front. a's message at 10
// must still be taken before its message at 12, and b's after a's
// redelivery only as the queue has it: order between aggregates is free.
func TestRedeliveryStaysBehindItsAggregatesPutBackMessage(t *testing.T) {
	c := &Consumer{cfg: Config{BatchSize: 4, HandlerTimeout: 10 * time.Second}}
	w := newWorker(c, nil, 0)
	w.blocked["a"] = &block{head: 12}
	inFlight := []*item{queuedItem("a", 10), queuedItem("b", 11)}
	w.queue = []*item{queuedItem("c", 13)}
	w.enqueue(queuedItem("a", 12)) // the redelivery, while the batch is in flight
	w.finishAll(context.Background(), inFlight, oneByOne(batchOutcome{res: make([]result, len(inFlight))}, inFlight, []int{0, 1}))
	var order []string
	for len(w.queue) > 0 {
		for _, it := range w.take() {
			order = append(order, it.m.ID)
		}
	}
	pos := func(id string) int {
		for i, o := range order {
			if o == id {
				return i
			}
		}
		return -1
	}
	if pos("a@10") < 0 || pos("a@12") < 0 || pos("a@10") > pos("a@12") {
		t.Errorf("taken in the order %v: want a@10 before a@12", order)
	}
	if len(order) != 4 {
		t.Errorf("taken %v: want each of the 4 messages once", order)
	}
}

// TestRedeliveryAfterItsAggregatesHeadMovedIsHeld: a's message at 12 is
// naked for a retry; then its message at 10, put back unattempted by a
// batch and taken alone, fails too, and becomes the block's head. The
// redelivery of 12 that arrives then is no longer the head: it must be
// held behind 10, not go ahead.
func TestRedeliveryAfterItsAggregatesHeadMovedIsHeld(t *testing.T) {
	c := &Consumer{cfg: Config{BatchSize: 4, HandlerTimeout: 10 * time.Second}}
	w := newWorker(c, nil, 0)
	b := &block{head: 10} // was 12; worker.finish moved it when a's message at 10 failed (retry && b != nil)
	w.blocked["a"] = b
	w.queue = []*item{queuedItem("c", 13)}
	w.enqueue(queuedItem("a", 12))
	taken := itemIDs(w.take())
	if strings.Contains(taken, "a@12") {
		t.Errorf("a@12 taken %s while a@10, the block's head now, waits for its redelivery", taken)
	}
	if len(b.held) != 1 || b.held[0].m.StreamSeq != 12 {
		t.Errorf("held %s, want [a@12]", itemIDs(b.held))
	}
}
