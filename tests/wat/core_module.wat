;; A core WebAssembly module, not a component: the host must refuse it at load.
(module
  (func (export "mid_process") (result i32) (i32.const 0))
)
