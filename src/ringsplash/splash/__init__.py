"""Splash (sparse flash) attention: Pallas TPU kernels, a jnp backend and the custom VJP."""

from ringsplash.splash.attention import splash_backward, splash_forward
from ringsplash.splash.config import SplashConfig
from ringsplash.splash.factory import SplashAttention, make_splash_attention, splash_attention

__all__ = ["SplashAttention", "SplashConfig", "make_splash_attention", "splash_attention", "splash_backward",
           "splash_forward"]
