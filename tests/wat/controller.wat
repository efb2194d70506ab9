;; A hand-written controller for the wasm host tests (tests/test_wasm_host.py).
;;
;; It implements world `aici:controller/controller-world@0.1.0` (wit/controller.wit) with the
;; canonical ABI written out by hand, so the tests need no componentize-py build. One
;; component covers every behaviour: the first byte of the constructor's `arg` picks it.
;;
;;   s  stop                        a  sample(allow [5, 7])
;;   A  sample(all)                 p  splice {backtrack 1, ff-tokens [10, 11]}
;;   h  echo: splice {backtrack = input.backtrack, ff-tokens = input.tokens}
;;   n  generate {grammar: some(regex "[0-9]+"), max-tokens 8, stop ["\n"]}
;;   z  generate with max-tokens 0  l  log "hello" + set-output answer=42, raw="not json"; stop
;;   c  trap (unreachable) in the constructor
;;   t  sample(all) four times, trap on the 5th mid-process call
;;   w  loop forever (deadline / fuel)
;;   g  grow memory one page at a time without bound, then abort via `handle_alloc_error`
;;   b  sample(allow [5, 100]): a token id beyond a 100-token vocabulary
;;   e  sample(allow []): an empty allow-list
;;   k  sample(bitmask [0xffffffff]): one word where a 100-token vocabulary needs four
;;   H  sample(host-set 77): an unknown handle
;;   x  err("nope")
;;   m  tokens-matching("(") and tokens-matching("[a-z]"): logs the error, samples the handle
;;   d  decode([99]) (the test's host raises on it), then stop
;;   L  log 2000 lines of 100 bytes; stop   O  set-output 300 distinct keys; stop
;;   v  log the vocab size, eos token, tokenize("hi") and token-bytes(3) results; stop
;;
;; Hostile modes (tests/test_hostile_controllers.py):
;;   r  recurse without end (stack exhaustion)
;;   B  sample(allow [5, 1000000])  f  splice {backtrack 0, ff-tokens [10, 1000000]}
;;   K  sample(bitmask) of the right length with every bit set, past the vocabulary too
;;   M  log 1 MiB per call, then sample(all)
;;   E  log 2000 empty lines per call, then sample(all)
;;   U  set-output 20 new keys per call (thousands over a run), then sample(all)
;;   V  set-output a 256 KiB value under a new key per call, then sample(all)
;;   X  err(1 MiB message)
;;   P  tokens-matching with a fresh pattern forever; return its first err as ours
;;   T  splice {backtrack 0, ff-tokens: 4Mi zeros} (16 MiB of guest memory)
;;   Y  splice {backtrack 0, ff-tokens: 256Ki zeros}  S  splice 4096 zeros on every call
;;   G  grow a table 64Ki elements at a time without bound (host memory, not linear memory)
;;
;; Memory map of the guest: 0..1023 constant strings and lists, 1024 the return area,
;; 2048 the mode byte, 2052 the call counter, 2056 the address of a 1 MiB buffer of 'x'
;; (0 until first used), 2064 a scratch return area for imports, 580..599 digits written
;; by $utoa, 4096.. a bump heap for `realloc` (never freed: a runner lives for one sequence).
(component
  (type $types-t
    (instance
      (type u32)
      (export "token-id" (type (eq 0)))
      (type (list 1))
      (type (option string))
      (type (record (field "backtrack" u32) (field "tokens" 2) (field "segment-text" 3)))
      (export "step-input" (type (eq 4)))
      (type (list u32))
      (type (variant (case "all") (case "allow" 2) (case "deny" 2) (case "bitmask" 6)
                     (case "host-set" u32) (case "not-host-set" u32)))
      (export "token-set" (type (eq 7)))
      (type (list string))
      (type (variant (case "json-schema" string) (case "regex" string) (case "lark" string)
                     (case "choice" 9)))
      (export "grammar" (type (eq 10)))
      (type (option 11))
      (type (record (field "grammar" 12) (field "max-tokens" u32) (field "stop" 9)))
      (export "segment" (type (eq 13)))
      (type (record (field "backtrack" u32) (field "ff-tokens" 2)))
      (export "splice" (type (eq 15)))
      (type (variant (case "sample" 8) (case "generate" 14) (case "splice" 16) (case "stop")))
      (export "action" (type (eq 17)))
    )
  )
  (import "aici:controller/types@0.1.0" (instance $types (type $types-t)))
  (alias export $types "token-id" (type $token-id))
  (alias export $types "step-input" (type $step-input))
  (alias export $types "action" (type $action))

  (import "aici:controller/tokenizer@0.1.0" (instance $tokenizer
    (export "vocab-size" (func (result u32)))
    (export "eos-token" (func (result u32)))
    (export "tokenize" (func (param "text" string) (result (list u32))))
    (export "decode" (func (param "tokens" (list u32)) (result string)))
    (export "token-bytes" (func (param "token" u32) (result (list u8))))
    (export "tokens-matching" (func (param "pattern" string) (result (result u32 (error string)))))
  ))
  (import "aici:controller/host@0.1.0" (instance $host
    (export "log" (func (param "message" string)))
    (export "set-output" (func (param "key" string) (param "value" string)))
  ))

  ;; Memory and allocator live in their own core module so that the imports can be
  ;; lowered against the memory before the main module is instantiated.
  (core module $Mem
    (memory (export "memory") 1)
    (global $heap (mut i32) (i32.const 4096))
    (func (export "realloc") (param $old i32) (param $old_size i32) (param $align i32)
                             (param $size i32) (result i32)
      (local $ptr i32) (local $end i32)
      ;; align up
      (local.set $ptr (i32.and (i32.add (global.get $heap) (i32.sub (local.get $align) (i32.const 1)))
                               (i32.sub (i32.const 0) (local.get $align))))
      (local.set $end (i32.add (local.get $ptr) (local.get $size)))
      (if (i32.gt_u (local.get $end) (i32.mul (memory.size) (i32.const 65536)))
        (then
          (if (i32.eq (memory.grow (i32.add (i32.shr_u (i32.sub (local.get $end)
                                                                (i32.mul (memory.size) (i32.const 65536)))
                                                       (i32.const 16))
                                            (i32.const 1)))
                      (i32.const -1))
            (then unreachable))))
      (if (local.get $old_size)
        (then (memory.copy (local.get $ptr) (local.get $old) (local.get $old_size))))
      (global.set $heap (local.get $end))
      (local.get $ptr))
  )
  (core instance $mem (instantiate $Mem))
  (alias core export $mem "memory" (core memory $memory))
  (alias core export $mem "realloc" (core func $realloc))

  (core func $vocab-size (canon lower (func $tokenizer "vocab-size")))
  (core func $eos-token (canon lower (func $tokenizer "eos-token")))
  (core func $tokenize (canon lower (func $tokenizer "tokenize")
    (memory $memory) (realloc $realloc) string-encoding=utf8))
  (core func $decode (canon lower (func $tokenizer "decode")
    (memory $memory) (realloc $realloc) string-encoding=utf8))
  (core func $token-bytes (canon lower (func $tokenizer "token-bytes")
    (memory $memory) (realloc $realloc)))
  (core func $tokens-matching (canon lower (func $tokenizer "tokens-matching")
    (memory $memory) (realloc $realloc) string-encoding=utf8))
  (core func $log (canon lower (func $host "log") (memory $memory) string-encoding=utf8))
  (core func $set-output (canon lower (func $host "set-output")
    (memory $memory) string-encoding=utf8))

  (type $runner (resource (rep i32)))
  (core func $runner-new (canon resource.new $runner))

  (core module $Main
    (import "env" "memory" (memory 1))
    (import "env" "realloc" (func $realloc (param i32 i32 i32 i32) (result i32)))
    (import "env" "runner-new" (func $runner-new (param i32) (result i32)))
    (import "tokenizer" "vocab-size" (func $vocab-size (result i32)))
    (import "tokenizer" "eos-token" (func $eos-token (result i32)))
    (import "tokenizer" "tokenize" (func $tokenize (param i32 i32 i32)))
    (import "tokenizer" "decode" (func $decode (param i32 i32 i32)))
    (import "tokenizer" "token-bytes" (func $token-bytes (param i32 i32)))
    (import "tokenizer" "tokens-matching" (func $tokens-matching (param i32 i32 i32)))
    (import "host" "log" (func $log (param i32 i32)))
    (import "host" "set-output" (func $set-output (param i32 i32 i32 i32)))
    (table $table 1 funcref)

    (data (i32.const 0) "hello")
    (data (i32.const 16) "answer")
    (data (i32.const 32) "42")
    (data (i32.const 48) "raw")
    (data (i32.const 64) "not json")
    (data (i32.const 80) "nope")
    (data (i32.const 96) "[0-9]+")
    (data (i32.const 112) "\n")
    (data (i32.const 128) "(")
    (data (i32.const 144) "[a-z]")
    (data (i32.const 160) "hi")
    ;; u32 lists: [5, 7] at 200, [5, 100] at 208, [10, 11] at 216, [0xffffffff] at 224
    (data (i32.const 200) "\05\00\00\00\07\00\00\00\05\00\00\00\64\00\00\00\0a\00\00\00\0b\00\00\00")
    (data (i32.const 224) "\ff\ff\ff\ff")
    ;; [5, 1000000] at 232: an id beyond any test vocabulary
    (data (i32.const 232) "\05\00\00\00\40\42\0f\00")
    ;; list<string> ["\n"] at 240: one (ptr, len) pair
    (data (i32.const 240) "\70\00\00\00\01\00\00\00")
    ;; one log line of 100 bytes at 256
    (data (i32.const 256) "0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789")
    (data (i32.const 400) "k__")
    ;; [99] at 416
    (data (i32.const 416) "\63\00\00\00")
    ;; [10, 1000000] at 432
    (data (i32.const 432) "\0a\00\00\00\40\42\0f\00")

    (func $utoa (param $v i32) (result i32)
      ;; Writes a number as decimal text ending at 600 (backwards); returns its start.
      (local $p i32)
      (local.set $p (i32.const 600))
      (loop $digits
        (local.set $p (i32.sub (local.get $p) (i32.const 1)))
        (i32.store8 (local.get $p)
          (i32.add (i32.const 48) (i32.rem_u (local.get $v) (i32.const 10))))
        (local.set $v (i32.div_u (local.get $v) (i32.const 10)))
        (br_if $digits (local.get $v)))
      (local.get $p))

    (func $log-u32 (param $v i32)
      (local $p i32)
      (local.set $p (call $utoa (local.get $v)))
      (call $log (local.get $p) (i32.sub (i32.const 600) (local.get $p))))

    (func $big (result i32)
      ;; A 1 MiB buffer of 'x', allocated and filled on first use.
      (if (i32.eqz (i32.load (i32.const 2056)))
        (then
          (i32.store (i32.const 2056)
            (call $realloc (i32.const 0) (i32.const 0) (i32.const 1) (i32.const 1048576)))
          (memory.fill (i32.load (i32.const 2056)) (i32.const 120) (i32.const 1048576))))
      (i32.load (i32.const 2056)))

    (func $zeros (param $n i32) (result i32)
      ;; A fresh list of `n` u32 zeros (token 0) from the bump heap, which is never reused.
      (call $realloc (i32.const 0) (i32.const 0) (i32.const 4)
                     (i32.shl (local.get $n) (i32.const 2))))

    (func $recurse (param $n i32) (result i32)
      ;; No base case: ends only when wasmtime's stack limit does.
      (i32.add (call $recurse (i32.add (local.get $n) (i32.const 1))) (i32.const 1)))

    (func $err (param $ptr i32) (param $len i32) (result i32)
      (i32.store8 (i32.const 1024) (i32.const 1)) ;; err
      (i32.store (i32.const 1028) (local.get $ptr))
      (i32.store (i32.const 1032) (local.get $len))
      (i32.const 1024))

    (func $handle_alloc_error
      ;; Named like Rust's allocator failure hook: the host recognises it in backtraces.
      unreachable)

    (func (export "ctor") (param $argp i32) (param $argl i32) (param $pp i32) (param $pl i32)
                          (result i32)
      (if (local.get $argl)
        (then (i32.store8 (i32.const 2048) (i32.load8_u (local.get $argp)))))
      (if (i32.eq (i32.load8_u (i32.const 2048)) (i32.const 99)) ;; 'c'
        (then unreachable))
      (call $runner-new (i32.const 1)))

    ;; Writes ok(sample(<token-set tag> (ptr, len))) to the return area.
    (func $sample (param $set_tag i32) (param $ptr i32) (param $len i32) (result i32)
      (i32.store8 (i32.const 1024) (i32.const 0))   ;; result: ok
      (i32.store8 (i32.const 1028) (i32.const 0))   ;; action: sample
      (i32.store8 (i32.const 1032) (local.get $set_tag))
      (i32.store (i32.const 1036) (local.get $ptr))
      (i32.store (i32.const 1040) (local.get $len))
      (i32.const 1024))

    (func $stop (result i32)
      (i32.store8 (i32.const 1024) (i32.const 0))   ;; ok
      (i32.store8 (i32.const 1028) (i32.const 3))   ;; stop
      (i32.const 1024))

    (func $splice (param $bt i32) (param $ptr i32) (param $len i32) (result i32)
      (i32.store8 (i32.const 1024) (i32.const 0))   ;; ok
      (i32.store8 (i32.const 1028) (i32.const 2))   ;; splice
      (i32.store (i32.const 1032) (local.get $bt))
      (i32.store (i32.const 1036) (local.get $ptr))
      (i32.store (i32.const 1040) (local.get $len))
      (i32.const 1024))

    (func $generate (param $max i32) (result i32)
      (i32.store8 (i32.const 1024) (i32.const 0))   ;; ok
      (i32.store8 (i32.const 1028) (i32.const 1))   ;; generate
      (i32.store8 (i32.const 1032) (i32.const 1))   ;; grammar: some
      (i32.store8 (i32.const 1036) (i32.const 1))   ;; regex
      (i32.store (i32.const 1040) (i32.const 96))
      (i32.store (i32.const 1044) (i32.const 6))
      (i32.store (i32.const 1048) (local.get $max)) ;; max-tokens
      (i32.store (i32.const 1052) (i32.const 240))  ;; stop list
      (i32.store (i32.const 1056) (i32.const 1))
      (i32.const 1024))

    (func (export "mid-process") (param $self i32) (param $bt i32) (param $tp i32) (param $tl i32)
                                 (param $has_text i32) (param $textp i32) (param $textl i32)
                                 (result i32)
      (local $mode i32) (local $i i32) (local $p i32) (local $n i32)
      (local.set $mode (i32.load8_u (i32.const 2048)))
      (i32.store (i32.const 2052) (i32.add (i32.load (i32.const 2052)) (i32.const 1)))

      (if (i32.eq (local.get $mode) (i32.const 115)) ;; 's'
        (then (return (call $stop))))
      (if (i32.eq (local.get $mode) (i32.const 97)) ;; 'a'
        (then (return (call $sample (i32.const 1) (i32.const 200) (i32.const 2)))))
      (if (i32.eq (local.get $mode) (i32.const 65)) ;; 'A'
        (then (return (call $sample (i32.const 0) (i32.const 0) (i32.const 0)))))
      (if (i32.eq (local.get $mode) (i32.const 112)) ;; 'p'
        (then (return (call $splice (i32.const 1) (i32.const 216) (i32.const 2)))))
      (if (i32.eq (local.get $mode) (i32.const 104)) ;; 'h'
        (then (return (call $splice (local.get $bt) (local.get $tp) (local.get $tl)))))
      (if (i32.eq (local.get $mode) (i32.const 110)) ;; 'n'
        (then (return (call $generate (i32.const 8)))))
      (if (i32.eq (local.get $mode) (i32.const 122)) ;; 'z'
        (then (return (call $generate (i32.const 0)))))
      (if (i32.eq (local.get $mode) (i32.const 108)) ;; 'l'
        (then
          (call $log (i32.const 0) (i32.const 5))
          (call $set-output (i32.const 16) (i32.const 6) (i32.const 32) (i32.const 2))
          (call $set-output (i32.const 48) (i32.const 3) (i32.const 64) (i32.const 8))
          (return (call $stop))))
      (if (i32.eq (local.get $mode) (i32.const 116)) ;; 't'
        (then
          (if (i32.ge_u (i32.load (i32.const 2052)) (i32.const 5)) (then unreachable))
          (return (call $sample (i32.const 0) (i32.const 0) (i32.const 0)))))
      (if (i32.eq (local.get $mode) (i32.const 119)) ;; 'w'
        (then (loop $forever (br $forever))))
      (if (i32.eq (local.get $mode) (i32.const 103)) ;; 'g'
        (then
          (loop $more
            (br_if $more (i32.ne (memory.grow (i32.const 1)) (i32.const -1))))
          (call $handle_alloc_error)))
      (if (i32.eq (local.get $mode) (i32.const 98)) ;; 'b'
        (then (return (call $sample (i32.const 1) (i32.const 208) (i32.const 2)))))
      (if (i32.eq (local.get $mode) (i32.const 101)) ;; 'e'
        (then (return (call $sample (i32.const 1) (i32.const 200) (i32.const 0)))))
      (if (i32.eq (local.get $mode) (i32.const 107)) ;; 'k'
        (then (return (call $sample (i32.const 3) (i32.const 224) (i32.const 1)))))
      (if (i32.eq (local.get $mode) (i32.const 72)) ;; 'H'
        (then
          (call $sample (i32.const 4) (i32.const 0) (i32.const 0))
          (i32.store (i32.const 1036) (i32.const 77))
          (return)))
      (if (i32.eq (local.get $mode) (i32.const 120)) ;; 'x'
        (then
          (i32.store8 (i32.const 1024) (i32.const 1)) ;; err
          (i32.store (i32.const 1028) (i32.const 80))
          (i32.store (i32.const 1032) (i32.const 4))
          (return (i32.const 1024))))
      (if (i32.eq (local.get $mode) (i32.const 109)) ;; 'm'
        (then
          (call $tokens-matching (i32.const 128) (i32.const 1) (i32.const 2064))
          (if (i32.load8_u (i32.const 2064)) ;; err: log the message
            (then (call $log (i32.load (i32.const 2068)) (i32.load (i32.const 2072)))))
          (call $tokens-matching (i32.const 144) (i32.const 5) (i32.const 2064))
          (if (i32.load8_u (i32.const 2064)) (then unreachable))
          (return (call $sample (i32.const 4) (i32.load (i32.const 2068)) (i32.const 0)))))
      (if (i32.eq (local.get $mode) (i32.const 100)) ;; 'd'
        (then
          (call $decode (i32.const 416) (i32.const 1) (i32.const 2064))
          (return (call $stop))))
      (if (i32.eq (local.get $mode) (i32.const 76)) ;; 'L'
        (then
          (loop $lines
            (call $log (i32.const 256) (i32.const 100))
            (local.set $i (i32.add (local.get $i) (i32.const 1)))
            (br_if $lines (i32.lt_u (local.get $i) (i32.const 2000))))
          (return (call $stop))))
      (if (i32.eq (local.get $mode) (i32.const 79)) ;; 'O'
        (then
          (loop $keys
            (i32.store8 (i32.const 401) (i32.add (i32.const 97) (i32.div_u (local.get $i) (i32.const 26))))
            (i32.store8 (i32.const 402) (i32.add (i32.const 97) (i32.rem_u (local.get $i) (i32.const 26))))
            (call $set-output (i32.const 400) (i32.const 3) (i32.const 32) (i32.const 2))
            (local.set $i (i32.add (local.get $i) (i32.const 1)))
            (br_if $keys (i32.lt_u (local.get $i) (i32.const 300))))
          (return (call $stop))))
      (if (i32.eq (local.get $mode) (i32.const 118)) ;; 'v'
        (then
          (call $log-u32 (call $vocab-size))
          (call $log-u32 (call $eos-token))
          (call $tokenize (i32.const 160) (i32.const 2) (i32.const 2064))
          (call $log-u32 (i32.load (i32.const 2068)))                          ;; length
          (call $log-u32 (i32.load (i32.load (i32.const 2064))))               ;; first id
          (call $token-bytes (i32.const 3) (i32.const 2064))
          (call $log (i32.load (i32.const 2064)) (i32.load (i32.const 2068)))  ;; the bytes
          (return (call $stop))))
      (if (i32.eq (local.get $mode) (i32.const 114)) ;; 'r'
        (then (drop (call $recurse (i32.const 0))) unreachable))
      (if (i32.eq (local.get $mode) (i32.const 66)) ;; 'B'
        (then (return (call $sample (i32.const 1) (i32.const 232) (i32.const 2)))))
      (if (i32.eq (local.get $mode) (i32.const 102)) ;; 'f'
        (then (return (call $splice (i32.const 0) (i32.const 432) (i32.const 2)))))
      (if (i32.eq (local.get $mode) (i32.const 75)) ;; 'K'
        (then
          (local.set $n (i32.shr_u (i32.add (call $vocab-size) (i32.const 31)) (i32.const 5)))
          (local.set $p (call $realloc (i32.const 0) (i32.const 0) (i32.const 4)
                                       (i32.shl (local.get $n) (i32.const 2))))
          (memory.fill (local.get $p) (i32.const 255) (i32.shl (local.get $n) (i32.const 2)))
          (return (call $sample (i32.const 3) (local.get $p) (local.get $n)))))
      (if (i32.eq (local.get $mode) (i32.const 77)) ;; 'M'
        (then
          (call $log (call $big) (i32.const 1048576))
          (return (call $sample (i32.const 0) (i32.const 0) (i32.const 0)))))
      (if (i32.eq (local.get $mode) (i32.const 69)) ;; 'E'
        (then
          (loop $lines
            (call $log (i32.const 0) (i32.const 0))
            (local.set $i (i32.add (local.get $i) (i32.const 1)))
            (br_if $lines (i32.lt_u (local.get $i) (i32.const 2000))))
          (return (call $sample (i32.const 0) (i32.const 0) (i32.const 0)))))
      (if (i32.eq (local.get $mode) (i32.const 85)) ;; 'U'
        (then
          (loop $keys
            (local.set $p (call $utoa (i32.add (i32.mul (i32.load (i32.const 2052)) (i32.const 20))
                                               (local.get $i))))
            (call $set-output (local.get $p) (i32.sub (i32.const 600) (local.get $p))
                              (i32.const 32) (i32.const 2))
            (local.set $i (i32.add (local.get $i) (i32.const 1)))
            (br_if $keys (i32.lt_u (local.get $i) (i32.const 20))))
          (return (call $sample (i32.const 0) (i32.const 0) (i32.const 0)))))
      (if (i32.eq (local.get $mode) (i32.const 86)) ;; 'V'
        (then
          (local.set $p (call $utoa (i32.load (i32.const 2052))))
          (call $set-output (local.get $p) (i32.sub (i32.const 600) (local.get $p))
                            (call $big) (i32.const 262144))
          (return (call $sample (i32.const 0) (i32.const 0) (i32.const 0)))))
      (if (i32.eq (local.get $mode) (i32.const 88)) ;; 'X'
        (then (return (call $err (call $big) (i32.const 1048576)))))
      (if (i32.eq (local.get $mode) (i32.const 80)) ;; 'P'
        (then
          (loop $patterns
            (local.set $p (call $utoa (local.get $i)))
            (call $tokens-matching (local.get $p) (i32.sub (i32.const 600) (local.get $p))
                                   (i32.const 2064))
            (if (i32.load8_u (i32.const 2064))
              (then (return (call $err (i32.load (i32.const 2068)) (i32.load (i32.const 2072))))))
            (local.set $i (i32.add (local.get $i) (i32.const 1)))
            (br $patterns))))
      (if (i32.eq (local.get $mode) (i32.const 71)) ;; 'G'
        (then
          (loop $more
            (br_if $more (i32.ne (table.grow $table (ref.null func) (i32.const 65536))
                                 (i32.const -1))))
          (call $handle_alloc_error)))
      (if (i32.eq (local.get $mode) (i32.const 84)) ;; 'T'
        (then (return (call $splice (i32.const 0) (call $zeros (i32.const 4194304))
                                    (i32.const 4194304)))))
      (if (i32.eq (local.get $mode) (i32.const 89)) ;; 'Y'
        (then (return (call $splice (i32.const 0) (call $zeros (i32.const 262144))
                                    (i32.const 262144)))))
      (if (i32.eq (local.get $mode) (i32.const 83)) ;; 'S'
        (then (return (call $splice (i32.const 0) (call $zeros (i32.const 4096))
                                    (i32.const 4096)))))
      unreachable)
  )
  (core instance $main (instantiate $Main
    (with "env" (instance
      (export "memory" (memory $memory))
      (export "realloc" (func $realloc))
      (export "runner-new" (func $runner-new))))
    (with "tokenizer" (instance
      (export "vocab-size" (func $vocab-size))
      (export "eos-token" (func $eos-token))
      (export "tokenize" (func $tokenize))
      (export "decode" (func $decode))
      (export "token-bytes" (func $token-bytes))
      (export "tokens-matching" (func $tokens-matching))))
    (with "host" (instance
      (export "log" (func $log))
      (export "set-output" (func $set-output))))
  ))

  (func $ctor (param "arg" string) (param "prompt" (list $token-id)) (result (own $runner))
    (canon lift (core func $main "ctor") (memory $memory) (realloc $realloc) string-encoding=utf8))
  (func $mid-process (param "self" (borrow $runner)) (param "input" $step-input)
                     (result (result $action (error string)))
    (canon lift (core func $main "mid-process") (memory $memory) (realloc $realloc)
      string-encoding=utf8))

  ;; Exported functions may only mention types that have names where they are exported,
  ;; so the interface is assembled inside a nested component that imports the types and
  ;; functions and re-exports them under their WIT names (what wit-component does too).
  (component $Controller
    (type $u32 u32)
    (import "token-id" (type $token-id' (eq $u32)))
    (type $step-input-t (record (field "backtrack" u32) (field "tokens" (list $token-id'))
                                (field "segment-text" (option string))))
    (import "step-input" (type $step-input' (eq $step-input-t)))
    (type $token-set-t (variant (case "all") (case "allow" (list $token-id'))
                                (case "deny" (list $token-id')) (case "bitmask" (list u32))
                                (case "host-set" u32) (case "not-host-set" u32)))
    (import "token-set" (type $token-set' (eq $token-set-t)))
    (type $grammar-t (variant (case "json-schema" string) (case "regex" string)
                              (case "lark" string) (case "choice" (list string))))
    (import "grammar" (type $grammar' (eq $grammar-t)))
    (type $segment-t (record (field "grammar" (option $grammar')) (field "max-tokens" u32)
                             (field "stop" (list string))))
    (import "segment" (type $segment' (eq $segment-t)))
    (type $splice-t (record (field "backtrack" u32) (field "ff-tokens" (list $token-id'))))
    (import "splice" (type $splice' (eq $splice-t)))
    (type $action-t (variant (case "sample" $token-set') (case "generate" $segment')
                             (case "splice" $splice') (case "stop")))
    (import "action" (type $action' (eq $action-t)))
    (import "runner" (type $runner' (sub resource)))
    (import "ctor" (func $ctor' (param "arg" string) (param "prompt" (list $token-id'))
                                (result (own $runner'))))
    (import "mid-process" (func $mid-process' (param "self" (borrow $runner'))
                                              (param "input" $step-input')
                                              (result (result $action' (error string)))))
    (export $token-id-e "token-id" (type $token-id'))
    (export $step-input-e "step-input" (type $step-input'))
    (export $action-e "action" (type $action'))
    (export $runner-e "runner" (type $runner'))
    (export "[constructor]runner" (func $ctor')
      (func (param "arg" string) (param "prompt" (list $token-id-e)) (result (own $runner-e))))
    (export "[method]runner.mid-process" (func $mid-process')
      (func (param "self" (borrow $runner-e)) (param "input" $step-input-e)
            (result (result $action-e (error string)))))
  )
  (alias export $types "token-set" (type $token-set))
  (alias export $types "grammar" (type $grammar))
  (alias export $types "segment" (type $segment))
  (alias export $types "splice" (type $splice))
  (instance $controller (instantiate $Controller
    (with "token-id" (type $token-id))
    (with "step-input" (type $step-input))
    (with "token-set" (type $token-set))
    (with "grammar" (type $grammar))
    (with "segment" (type $segment))
    (with "splice" (type $splice))
    (with "action" (type $action))
    (with "runner" (type $runner))
    (with "ctor" (func $ctor))
    (with "mid-process" (func $mid-process))))
  (export "aici:controller/controller@0.1.0" (instance $controller))
)
