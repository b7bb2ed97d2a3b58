"""Moving a request's KV slots between nodes: zmq handshake + per-pair torch.distributed groups.

``transfer`` knows tensors, slot lists and transfer ids, nothing about requests or models.
Each node makes one ``TransferAgent`` over its KV buffers (``k[0..L-1] + v[0..L-1]``) and
calls ``agent.progress()`` (or a handle's ``poll()``) from its event loop; nothing blocks.

The life of a transfer (P = prefill node, sending; D = decode node, receiving):

1. D announces ``agent.endpoint``. P calls ``agent.sender(tid, d_endpoint, num_tokens,
   token_ids=None)``: it sends ``TransferRequestMsg`` (naming the pair group incarnation to
   use) and the pair group starts its rendezvous on a worker thread, its keys carried as
   sealed ``PairKeyMsg``s both ways on the control plane (``rendezvous.py``).
   State BOOTSTRAPPING.
2. D checks the layout and asks its ``BaseSlotOwner.reserve`` for slots (it may already hold
   a prefix: ``num_cached_tokens``). A request for an id the owner does not know yet
   (``knows``: D's own announcement of the request is still on the way) is held, not refused,
   and answered once the owner knows it (bounded: ``receiver.py``). No room -> ``NoRoomMsg``;
   P asks again every ``retry_interval_s`` until ``handshake_timeout_s`` (``num_retries``).
   Room -> ``TransferReadyMsg(slots, num_cached_tokens)``; both sides are WAITING, D's
   deadline ``timeout_s`` starts.
3. P calls ``sender.send(src_slots)`` (before or after step 2; ``num_ready_layers`` +
   ``set_ready_layers`` let it start while later layers are still being computed). Once
   ready, P sends ``TransferStartMsg`` and queues the data on the pair: TRANSFERRING.
4. The pair worker sends a header, then per layer the K and V rows of the slots after the
   cached prefix, in the order and pieces of the sender's wire plan (``layout.py``, named in
   ``TransferStartMsg``): a side whose slots form few runs moves them straight from/into its
   pool, else it gathers/scatters through staging buffers on a copy thread. One pair moves
   one transfer at a time, so concurrent transfers never interleave.
5. D's data is in place: D is SUCCESS (the slots are now the owner's: ``landed``) and sends
   ``TransferDoneMsg``; P is SUCCESS on the ack and may unlock its source slots.
6. Any error, timeout or ``abort()`` makes that side FAILED and sends ``TransferAbortMsg``;
   D releases its reserved slots through the slot owner as soon as no worker can write into
   them. A pair that errored or timed out is closed and rebuilt under a new prefix.

The package exports nothing: import each name from the module that defines it (``agent``,
``sender``, ``receiver``, ``state``), so that importing one light module (``endpoint``, ``auth``)
does not load the whole engine, zmq included.
"""
