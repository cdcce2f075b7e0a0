// Package provision owns the shape of the JetStream streams the relay
// publishes to: creating them (EnsureStream), their partition layout (a
// subject transform, changed only over an empty stream), and the checks of
// an existing stream's subjects, durability, retention and limits
// (CheckShape, CheckStream) that `setup`, `run` and the tools (reconcile,
// repair, cleanup) share. The stage packages (replication, router,
// publisher) are the data path only: publisher publishes into a stream
// this package has checked.
//
// See https://docs.nats.io/nats-concepts/jetstream/streams for the stream
// configuration and https://docs.nats.io/nats-concepts/subject_mapping for
// subject transforms.
package provision
